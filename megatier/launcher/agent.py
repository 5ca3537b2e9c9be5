"""The node agent of in-process recovery: starts a node's training processes and hot spares, keeps the survivors.

torchrun's agent stops every process of its node when one fails and restarts them all, which is a relaunch.
This agent (``megatier-agent``, one per node) instead

* starts ``procs`` ranks (global rank ``node_rank * procs + local``) and ``spares`` idle hot spares, each with
  its lifelong member id (``<node>/<local>``, ``<node>/spare<k>``), the membership store's address and the
  launch's run id (:mod:`megatier.training.inprocess`); their process groups rendezvous on that store;
* reports each process that exits with a failure as dead to the membership round, so the survivors' round
  does not wait for it, and leaves every other process running;
* kills a process that has been stopped (SIGSTOP, say) for ``hang_timeout_s`` (:mod:`megatier.launcher.watchdog`),
  so its peers and the round go on at once instead of after the collective's timeout;
* kills a process that a round left out of the re-formed job without its having exited (a hung rank: the
  round went on without it after ``recovery.round_timeout_s``), so it never comes back as a second holder;
* with ``respawn``, starts a new hot spare (``<node>/spare<k>``, the next k) in place of each process that
  failed, so a long job keeps its spares through any number of failures, as a cluster's agent restarts a
  crashed worker; a process that ended with a status the job explains (a refusal, exit 7, a clean stop) or
  after the job ended is not replaced;
* beats its node's lease (:class:`~megatier.parallel.membership.NodeLeases`) from a thread of its own, so
  the rounds learn of a machine that died with its agent, and a busy agent never looks like a dead one;
* optionally serves the membership store itself (``serve_store``): the store must outlive any one training
  process, so it runs in an agent (or a host of its own), never in a rank.

Its exit status is 0 when every failed process was replaced by a later round and the job ended well, else the
worst status of its processes (a death by signal s counts as 128 + s).
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from megatier.launcher.watchdog import DEFAULT_HANG_TIMEOUT_S, StoppedWatch
from megatier.parallel.membership import BEAT_S, PREFIX, MembershipRound, beat

ENV_STORE = "MEGATIER_MEMBERSHIP_STORE"  # host:port of the membership store
ENV_MEMBER = "MEGATIER_MEMBER_ID"  # a process's lifelong id
ENV_SPARE = "MEGATIER_SPARE"  # "1": start idle and wait for a round to give the process a rank
ENV_RUN = "MEGATIER_RUN_ID"  # the launch's id: its rounds' keys, apart from other launches on the same store
FAULT_ENV = ("MEGATIER_CRASH_AT",)
# A stop is no death to recover: Ctrl-C (every rank stops after the same step, 130) or a second SIGTERM (143).
# (A drained SIGTERM ends with 0.)
STOPPED = (130, 143)  # a drill's armed crash belongs to the rank it was armed on, not to a spare
# The statuses a training process ends with on its own (megatier.training.outcome): no failure to replace.
ENDED = frozenset({0, 2, 3, 4, 5, 6, 7, *STOPPED})


def _die_with_parent() -> None:
    """A preexec function (Linux): the process is killed when its agent dies, as it would be with its machine;
    a rank or spare that outlived its agent would run unwatched (nobody reports its death or stops it)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def exit_status(returncode: int) -> int:
    """Shell-style status: a death by signal s becomes 128 + s."""
    return 128 - returncode if returncode < 0 else returncode


def serve_store(port: int, timeout_s: float = 3600.0) -> dist.TCPStore:
    """The membership store, served from this process on ``port`` (0: a free one; see ``.port``)."""
    return dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def connect_store(address: str, timeout_s: float = 60.0) -> dist.TCPStore:
    host, _, port = address.rpartition(":")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


def run_prefix(run_id: str) -> str:
    """The membership rounds' key prefix of launch ``run_id`` (the trainer derives the same from MEGATIER_RUN_ID)."""
    return f"{PREFIX}/{run_id}"


@dataclass
class Child:
    member: str
    process: subprocess.Popen
    reported: Optional[int] = None  # rounds decided when its death was reported (None: not dead)
    replaced: bool = False  # a new spare was started in its place (respawn)
    rank: Optional[int] = None  # its rank in the current world (as far as this agent has read the rounds)

    @property
    def holds_rank(self) -> bool:
        return self.rank is not None

    def describe(self) -> str:
        """Who it is, for the console: member id, rank (or spare) and pid."""
        return f"{self.member} ({'spare' if self.rank is None else f'rank {self.rank}'}, pid {self.process.pid})"


def death(returncode: int) -> str:
    """How a process ended, in words: a signal by its name, else its exit status."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


class NodeAgent:
    """The agent of node ``node`` (see the module docstring)."""

    def __init__(self, script_args: list[str], *, node: str, node_rank: int, nodes: int, procs: int, spares: int,
                 store: str, run_id: str, respawn: bool = False, hang_timeout_s: float = DEFAULT_HANG_TIMEOUT_S):
        if procs < 0 or spares < 0 or procs + spares < 1:
            raise ValueError(f"--nproc-per-node {procs} and --spares-per-node {spares}: start at least one process")
        self.script_args, self.node, self.node_rank = script_args, node, node_rank
        self.nodes, self.procs, self.spares = nodes, procs, spares
        self.address, self.run_id, self.respawn = store, run_id, respawn
        self._spares_started = 0  # spares started so far: the next one's member id
        self.children: list[Child] = []
        self.store: Optional[dist.TCPStore] = None
        self.prefix = run_prefix(run_id)
        self._read_rounds = 0  # decided rounds this agent has acted on
        self._done = threading.Event()  # set when the agent ends: its lease stops beating
        self.watchdog = StoppedWatch(hang_timeout_s)

    def _env(self, member: str, rank: Optional[int], local: int) -> dict:
        # The ranks this node will run: a node of spares runs as many as it has spares (threads per process follow).
        local_world = self.procs or self.spares
        env = dict(os.environ, MEGATIER_NODE_NAME=self.node, LOCAL_WORLD_SIZE=str(local_world),
                   **{ENV_STORE: self.address, ENV_MEMBER: member, ENV_RUN: self.run_id})
        if rank is None:
            env[ENV_SPARE] = "1"
            for key in FAULT_ENV:
                env.pop(key, None)
            for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
                env.pop(key, None)
        else:
            env.update(RANK=str(rank), WORLD_SIZE=str(self.nodes * self.procs), LOCAL_RANK=str(local))
        return env

    def start(self) -> None:
        self.store = connect_store(self.address)
        self._start_beating()
        command = [sys.executable, *self.script_args]
        first = MembershipRound(self.store, 0, self.prefix)
        for local in range(self.procs):
            member, rank = f"{self.node}/{local}", self.node_rank * self.procs + local
            first.publish_holder(rank, member)  # before the process exists: its death is a known rank's
            self.children.append(Child(member, self._spawn(command, self._env(member, rank, local)), rank=rank))
        for _ in range(self.spares):
            self._start_spare()

    def _start_spare(self) -> None:
        member = f"{self.node}/spare{self._spares_started}"
        self._spares_started += 1
        MembershipRound(self.store, 0, self.prefix).announce_spare(member)  # a round may wait for it to come up
        command = [sys.executable, *self.script_args]
        self.children.append(Child(member, self._spawn(command, self._env(member, None, 0))))

    @staticmethod
    def _spawn(command: list[str], env: dict) -> subprocess.Popen:
        return subprocess.Popen(command, env=env, preexec_fn=_die_with_parent)

    def _start_beating(self) -> None:
        """Renew this node's lease every BEAT_S, from a thread of its own on a store connection of its own: the
        rounds count a node whose agent stopped beating as lost, so the beat must not wait on what the agent
        does (starting processes on a loaded machine, reading a round, waiting for one at the end)."""
        store = connect_store(self.address)
        beat(store, self.prefix, self.node)

        def beat_forever() -> None:
            try:
                while not self._done.wait(BEAT_S):
                    beat(store, self.prefix, self.node)
            except (RuntimeError, OSError):  # the store is gone (the launch ended, or its host died): nobody to tell
                pass

        threading.Thread(target=beat_forever, name="megatier-agent-beat", daemon=True).start()

    def poll(self) -> bool:
        """Report the processes that failed since the last call, stop those a new round left out; True while
        any process runs."""
        self._kill_frozen()
        for child in self.children:
            code = child.process.poll()
            if code not in (None, 0, *STOPPED) and child.reported is None:
                child.reported = MembershipRound.decided_epochs(self.store, self.prefix)
                MembershipRound(self.store, 0, self.prefix).report_dead(child.member)
                self._say(f"{child.describe()} {death(code)}; reported to the membership round")
        self._follow_rounds()
        if self.respawn:
            self._replace_failed()
        return any(c.process.poll() is None for c in self.children)

    def _kill_frozen(self) -> None:
        """Kill each process the kernel has held stopped for the watchdog's timeout; the next look reports it."""
        now = time.monotonic()
        for child in self.children:
            stopped = self.watchdog.frozen(child.process.pid, now) if child.process.poll() is None else None
            if stopped is not None:
                self._say(f"{child.describe()} has been stopped for {stopped:.1f} s (frozen); killing it")
                child.process.kill()
                child.process.wait()

    def _replace_failed(self) -> None:
        """A new spare in place of each process that failed (died by a signal, crashed, or was left out of a
        round as hung), unless the job has ended."""
        for child in list(self.children):
            code = child.process.poll()
            if code is None or child.replaced or exit_status(code) in ENDED:
                continue
            if MembershipRound.finished(self.store, self.prefix):
                return
            child.replaced = True
            self._start_spare()
            self._say(f"{self.children[-1].member} (pid {self.children[-1].process.pid}) started as a spare in "
                      f"place of {child.member}")

    def _follow_rounds(self) -> None:
        decided = MembershipRound.decided_epochs(self.store, self.prefix)
        while self._read_rounds < decided:
            self._read_rounds += 1
            assignment = MembershipRound(self.store, self._read_rounds, self.prefix).outcome(5.0).assignment
            if assignment is None:
                continue
            for child in self.children:
                rank = assignment.rank_of(child.member)
                if child.holds_rank and rank is None and child.member not in assignment.idle \
                        and child.process.poll() is None:
                    self._say(f"{child.describe()} was left out of round {self._read_rounds} (hung); killing it")
                    child.process.kill()  # hung: the job went on without it (this round replaced it)
                    child.reported = self._read_rounds - 1
                child.rank = rank

    def _say(self, line: str) -> None:
        print(f"megatier-agent {self.node}: {line}", file=sys.stderr, flush=True)

    def _replaced(self, child: Child, wait_s: float) -> bool:
        """Whether a round after ``child``'s death formed a world without it; waits up to ``wait_s`` for one
        (the survivors may still be deciding when this node's last process has died)."""
        deadline = time.monotonic() + wait_s
        while True:
            decided = MembershipRound.decided_epochs(self.store, self.prefix)
            if any(MembershipRound(self.store, e, self.prefix).outcome(1.0).assignment is not None
                   for e in range(child.reported + 1, decided + 1)):
                return True
            if MembershipRound.finished(self.store, self.prefix) or time.monotonic() > deadline:
                return False
            time.sleep(0.1)

    def status(self, wait_s: float = 120.0) -> int:
        """0 when every failed process was replaced by a later round (a decision that formed a world) and the
        others ended well; else the worst exit status."""
        worst, deadline = 0, time.monotonic() + wait_s
        for child in self.children:
            code = exit_status(child.process.returncode)
            # A refusal (2: every rank refuses the same config) is the launch's answer: no round will replace it.
            replaceable = code != 2 and child.reported is not None
            if code and not (replaceable and self._replaced(child, max(0.0, deadline - time.monotonic()))):
                worst = max(worst, code)
        return worst

    def run(self, poll_s: float = 0.05) -> int:
        self.start()
        try:
            while self.poll():
                time.sleep(poll_s)
            self.poll()
            return self.status()
        finally:
            self.close()

    def close(self) -> None:
        """Stop beating this node's lease: the agent is done."""
        self._done.set()

    def stop(self, sig: int) -> None:
        for child in self.children:
            if child.process.poll() is None:
                child.process.send_signal(sig)
