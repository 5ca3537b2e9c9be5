"""The node agent's hang watchdog: a process that stops beating is frozen, and its agent kills it.

A rank that hangs leaves its peers waiting inside a collective until ``parallel.timeout_s`` runs out, and the
membership round then waits ``recovery.round_timeout_s`` more for a member that never joins. A frozen process
(stopped, stuck in the kernel, or holding the interpreter lock in native code) is told apart from its peers
waiting in a collective by a beat: each process the agent starts runs a thread that writes one byte every
:data:`BEAT_S` to a pipe the agent reads. A peer blocked in a collective waits without the interpreter lock, so
its thread beats on; a frozen process's does not. After ``hang_timeout_s`` of silence the agent kills it, and
its death then takes the path of any crash: its peers' collectives fail at once on the closed connections and
the agent reports it dead to the round, which does not wait for it.

A process whose threads still run but whose training makes no progress (a deadlock in Python, a collective
that never completes on a device) keeps beating: the collective's timeout still finds it. A process is judged
only after its first beat (its thread starts once the interpreter has imported the entry point), only until
it begins to exit (its exit handler closes the pipe: an interpreter that finalizes stops its threads, and
closing process groups may take a while), and only over time the agent itself watched: an agent that was
not scheduled for a while restarts every silence clock, as a loaded machine stalls the agent and its
processes alike.

This is in the spirit of NVIDIA Resiliency Extension's in-process restart, whose monitor ends a rank that
misses its heartbeat; the beat here crosses a pipe to the node's agent, so it costs no store traffic.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
from dataclasses import dataclass
from typing import Optional

ENV_BEAT_FD = "MEGATIER_BEAT_FD"  # the write end of the pipe a process beats on (set by its agent)
BEAT_S = 0.5  # how often a process beats
DEFAULT_HANG_TIMEOUT_S = 10.0  # silence after which an agent kills a process (0: never)
_AGENT_GAP_S = 2.0  # an agent loop slower than this was not watching: silence counts again from its return


def start_beating() -> bool:
    """In a process an agent started: beat on the pipe it named, from a daemon thread, until the process exits
    (then the pipe closes: the agent stops judging a process that is shutting down, which may take a while
    without beats once the interpreter finalizes). False when no agent watches this process."""
    fd = os.environ.pop(ENV_BEAT_FD, None)  # a child of this process (a compile worker) is not the agent's
    if fd is None:
        return False
    os.set_inheritable(int(fd), False)  # nor does the agent's pipe stay open in it
    done = threading.Event()
    thread = threading.Thread(target=_beat, args=(int(fd), done), name="megatier-beat", daemon=True)
    thread.start()

    def stop() -> None:
        done.set()
        thread.join(timeout=2 * BEAT_S)

    atexit.register(stop)  # registered first, so it runs after the job's own exit handlers
    return True


def _beat(fd: int, done: threading.Event) -> None:
    try:
        while not done.is_set():
            os.write(fd, b".")
            done.wait(BEAT_S)
    except OSError:  # the agent is gone (its end closed): nobody to tell
        pass
    os.close(fd)


@dataclass
class Beats:
    """One process's beats as its agent reads them: the read end of its pipe and when it last beat."""
    fd: int
    last: Optional[float] = None  # when the agent last read a beat (None: not yet beating)
    exiting: bool = False  # the process closed its end: it is shutting down, no longer judged

    def read(self, now: float) -> None:
        try:
            data = os.read(self.fd, 4096)
        except BlockingIOError:
            return
        if data:
            self.last = now
        else:
            self.exiting = True

    def close(self) -> None:
        os.close(self.fd)


class Watchdog:
    """The agent's side: a pipe per process it starts, and which of them have been silent for too long."""

    def __init__(self, hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S):
        if hang_timeout_s < 0:
            raise ValueError(f"--hang-timeout-s {hang_timeout_s} must be >= 0 (0 turns the hang watchdog off)")
        self.hang_timeout_s = hang_timeout_s
        self._watched: Optional[float] = None  # when the agent last looked
        self._since = time.monotonic()  # silence before this moment is not counted (the agent was not watching)

    @property
    def enabled(self) -> bool:
        return self.hang_timeout_s > 0

    def pipe(self) -> tuple[Optional[Beats], dict, tuple]:
        """For a process about to start: its Beats, the environment it needs and the fds it must inherit."""
        if not self.enabled:
            return None, {}, ()
        read_end, write_end = os.pipe()
        os.set_blocking(read_end, False)
        return Beats(read_end), {ENV_BEAT_FD: str(write_end)}, (write_end,)

    def look(self) -> float:
        """Start of one look over the processes: when it is, restarting every silence clock after a gap."""
        now = time.monotonic()
        if self._watched is not None and now - self._watched > _AGENT_GAP_S:
            self._since = now
        self._watched = now
        return now

    def silence(self, beats: Optional[Beats], now: float) -> Optional[float]:
        """Seconds ``beats``' process has been silent while watched, when that passed the timeout; else None."""
        if beats is None:
            return None
        beats.read(now)
        if beats.last is None or beats.exiting:
            return None
        silent = now - max(beats.last, self._since)
        return silent if silent > self.hang_timeout_s else None
