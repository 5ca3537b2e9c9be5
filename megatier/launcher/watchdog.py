"""The agent's hang watchdog: a process the kernel has held stopped for ``--hang-timeout-s`` is killed.

A rank stopped by a signal (SIGSTOP; SIGTTIN or SIGTTOU when a background process touches its terminal) holds
its peers in their next collective until its timeout (``parallel.timeout_s``, minutes), and then the round
waits ``recovery.round_timeout_s`` for it to join, which it never does. Its agent, on the same machine, can see
at once that it cannot make progress: its state in ``/proc/<pid>/stat`` is ``T`` (stopped). The agent kills it
once it has stayed stopped for the timeout; its death is then reported and recovered as a crash, and its peers'
collectives fail at once on the connections it closed.

Why the scheduler's word and not a beat: a beat sent from the process (a thread writing to a pipe) needs the
interpreter lock, and on a loaded machine a live rank can hold it for seconds (a collection after a round drops
the old process groups); such a beat kills live ranks. A stopped state is never a busy one. What this cannot
see is a hang whose threads still run (a deadlock, a device collective that never ends): that one still costs
the collective's timeout. A process under a debugger (``t``, tracing stop) is left alone.
"""
from __future__ import annotations

import time
from typing import Optional

DEFAULT_HANG_TIMEOUT_S = 10.0


def process_state(pid: int) -> Optional[str]:
    """The one-letter state of process ``pid`` (R, S, D, T, t, Z, ...), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2:][:1].decode()  # the command name in (...) may hold spaces or parentheses


class StoppedWatch:
    """Which of the watched processes have been stopped for ``timeout_s`` (0: none ever is)."""

    def __init__(self, timeout_s: float = DEFAULT_HANG_TIMEOUT_S):
        if timeout_s < 0:
            raise ValueError(f"--hang-timeout-s {timeout_s:g} must be >= 0 (0 turns the hang watchdog off)")
        self.timeout_s = timeout_s
        self._stopped_since: dict[int, float] = {}  # pid -> when it was first seen stopped, in this stop

    def frozen(self, pid: int, now: Optional[float] = None) -> Optional[float]:
        """How long ``pid`` has been stopped when that is at least the timeout; else None. Called on each of
        the agent's looks: a process seen running between two looks starts over."""
        if not self.timeout_s:
            return None
        now = time.monotonic() if now is None else now
        if process_state(pid) != "T":
            self._stopped_since.pop(pid, None)
            return None
        since = self._stopped_since.setdefault(pid, now)
        return now - since if now - since >= self.timeout_s else None
