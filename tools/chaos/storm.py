"""A failure storm: one in-process job through many faults, one about every ``--interval-s`` seconds of training.

    python tools/chaos/storm.py --faults 100 --interval-s 30 --iters 4000

The job (2 nodes x 2 processes, tp=2 x dp=2, lossless diffs, tiers local, peer and remote) runs under
in-process recovery with a spare on every node, a node of spares, and agents that start a new spare in place
of every process that fails (``megatier-launch --respawn``). While it trains, this process strikes at random
times (uniform between half and one and a half ``--interval-s``) with a random class of fault on a random
member of the job's current world:

* ``process``: SIGKILL one rank's process, wherever it is (its step, its checkpoint threads, a recovery);
* ``node``: SIGKILL a node's agent with its ranks and spares at once, its node memory wiped, and a new node
  of spares started in its place (a replacement machine);
* ``hang``: SIGSTOP one rank's process (its agent's watchdog kills it once it has been stopped for
  :data:`HANG_TIMEOUT_S`, and the job recovers it as a crash).

A fault that cannot be recovered in place (every rank lost at once) is recovered by a relaunch, as a
scheduler would, and the storm goes on once the relaunch trains. The job must end with exit 0 and the final
``state_digest`` of the same job run without faults (which this tool runs first, unless ``--reference`` names
an earlier one). Prints one row per fault and a summary: goodput
(productive time over wall time held, with its split, from the job's own goodput ledger) beside the
fault-free run's, the distribution of kill to the first step after each recovery, and the steps rerun per
fault class. Exit status 0 when the job ended bit-identical.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatier.drill.cluster import LocalCluster  # noqa: E402
from megatier.launcher.agent import run_prefix  # noqa: E402
from megatier.parallel.membership import MembershipRound  # noqa: E402
from tools.chaos.random_crashes import JOB, metrics  # noqa: E402

NODES, PROCS = 2, 2
CLASSES = {"process": 0.7, "node": 0.15, "hang": 0.15}  # the draw's weights
MAX_RELAUNCHES = 5
HANG_TIMEOUT_S = 5.0  # the agents' watchdog: a stopped process is killed after this long
# The job's own settings for a storm: a hang its watchdog cannot see is found by the collective's timeout, so
# keep it short; a round waits for the spare its agent starts in place of a lost process (a storm outpaces the
# spares started with the job) rather than shrink dp, which never grows back in place.
STORM_JOB = [a for a in JOB if not a.startswith(("train.iters", "parallel.timeout_s", "checkpoint.base_interval"))] + [
    "parallel.timeout_s=15", "checkpoint.base_interval=50", "recovery.wait_for_replacement_s=60"]


@dataclass
class Fault:
    index: int
    kind: str
    at: float  # wall-clock time of the strike
    member: str = "-"
    node: str = "-"
    step: Optional[int] = None  # the newest step the job had logged when it struck
    notes: list[str] = field(default_factory=list)


def _job_args(work: Path, iters: int) -> list[str]:
    return [str(REPO / "pretrain_gpt.py"), *STORM_JOB, f"train.iters={iters}", f"checkpoint.local.root={work}/shm",
            f"checkpoint.remote.url={work}/remote", f"logging.run_dir={work}/run"]


def _environment() -> None:
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MEGATIER_NODE_NAME",
                "MEGATIER_CRASH_AT"):
        os.environ.pop(var, None)
    os.environ.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled")


def _pids_of(cluster: LocalCluster) -> dict[str, int]:
    """member id -> pid of every live process of the launch: its agents' children, by the title each process
    gives itself (``megatier <member id> rank <r>`` or ``... spare``; megatier.training.inprocess)."""
    found = {}
    for index, agent in enumerate(cluster.agents):
        if agent.poll() is not None:
            continue
        for pid in cluster.workers(index):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    title = f.read().replace(b"\0", b" ").decode(errors="replace").split()
            except OSError:
                continue
            if len(title) >= 3 and title[0] == "megatier":
                found[title[1]] = pid
    return found


def _holders(cluster: LocalCluster) -> list[str]:
    """The members holding ranks in the newest world the rounds formed (the launch's, before any round)."""
    prefix = run_prefix(cluster.run_id)
    for epoch in range(MembershipRound.decided_epochs(cluster.store, prefix), 0, -1):
        assignment = MembershipRound(cluster.store, epoch, prefix).outcome(1.0).assignment
        if assignment is not None:
            return list(assignment.holders)
    return [f"node{n}/{i}" for n in range(NODES) for i in range(PROCS)]


class Watcher:
    """Tails the job's metrics files while it runs: its newest step, and when each recovery record appeared
    (written at the end of the first step after the recovery: the end of a kill-to-first-step)."""

    def __init__(self, run_dir: Path, poll_s: float = 0.25):
        self.run_dir, self.poll_s = run_dir, poll_s
        self.step = 0
        self.recoveries: list[tuple[float, dict]] = []
        self._offsets: dict[int, int] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.poll_s):
            self.read()

    def read(self) -> None:
        for path in sorted(glob.glob(str(self.run_dir / "metrics*.jsonl"))):
            try:
                with open(path, "rb") as f:
                    inode = os.fstat(f.fileno()).st_ino  # a new rank 0 rotates the file: follow it by inode
                    f.seek(self._offsets.get(inode, 0))
                    chunk = f.read()
            except FileNotFoundError:
                continue
            complete = chunk[:chunk.rfind(b"\n") + 1]
            self._offsets[inode] = self._offsets.get(inode, 0) + len(complete)
            complete = complete.decode()
            for line in complete.splitlines():
                self._take(json.loads(line) if line.strip() else {})

    def _take(self, record: dict) -> None:
        if "loss" in record and "step" in record:
            self.step = max(self.step, record["step"])
        if "recovery_total_s" in record:
            self.recoveries.append((time.time(), record))


class Storm:
    """Strikes the running ``cluster`` until ``faults`` faults or the job nears ``iters``."""

    def __init__(self, cluster: LocalCluster, watcher: Watcher, rng: random.Random, *, faults: int,
                 interval_s: float, iters: int, classes: dict[str, float]):
        self.cluster, self.watcher, self.rng = cluster, watcher, rng
        self.work = watcher.run_dir.parent
        self.wanted, self.interval_s, self.iters, self.classes = faults, interval_s, iters, classes
        self.faults: list[Fault] = []
        self.done = threading.Event()
        self.relaunches, self._launch_step = 0, 0  # a launch is struck once it trains past where it began

    def relaunched(self, cluster: LocalCluster) -> None:
        self.cluster, self.relaunches, self._launch_step = cluster, self.relaunches + 1, self.watcher.step
        if self.faults:
            self.faults[-1].notes.append("the launch ended (every rank lost), relaunched")

    def run(self) -> None:
        while len(self.faults) < self.wanted:
            if self.done.wait(self.rng.uniform(0.5, 1.5) * self.interval_s):
                return
            # A failure before a launch's world formed is the launch's own, not a recovery's; and a strike between
            # rounds, when no member of the world is alive yet, would strike nobody: wait for one.
            while self.watcher.step <= self._launch_step or not self._live():
                if self.done.wait(0.5):
                    return
            step = self.watcher.step
            if step >= self.iters - 2:
                return
            kind = self.rng.choices(list(self.classes), weights=list(self.classes.values()))[0]
            fault = Fault(len(self.faults) + 1, kind, time.time(), step=step)
            getattr(self, f"_{kind}")(fault)
            self.faults.append(fault)
            print(f"storm: fault {fault.index} {kind} on {fault.member} ({fault.node}) at step {step}"
                  f"{' ' + '; '.join(fault.notes) if fault.notes else ''}", file=sys.stderr, flush=True)

    def _live(self) -> dict[str, int]:
        """The current world's members that have a live process, with their pids."""
        pids = _pids_of(self.cluster)
        return {m: pids[m] for m in _holders(self.cluster) if m in pids}

    def _target(self, fault: Fault) -> Optional[int]:
        live = self._live()
        if not live:  # every one died since the strike was drawn
            fault.notes.append("no live rank to strike")
            return None
        fault.member = self.rng.choice(list(live))
        fault.node = fault.member.split("/")[0]
        return live[fault.member]

    def _process(self, fault: Fault) -> None:
        pid = self._target(fault)
        if pid is not None:
            _kill(pid, signal.SIGKILL)

    def _hang(self, fault: Fault) -> None:
        pid = self._target(fault)
        if pid is not None:
            _kill(pid, signal.SIGSTOP)

    def _node(self, fault: Fault) -> None:
        if self._target(fault) is None:
            return
        index = int(fault.node.removeprefix("node"))
        try:
            os.killpg(self.cluster.agents[index].pid, signal.SIGKILL)  # the agent, its ranks and spares at once
        except ProcessLookupError:
            fault.notes.append("its agent was gone already")
        for area in glob.glob(str(self.work / "shm" / "*" / fault.node)):
            shutil.rmtree(area, ignore_errors=True)  # the machine's memory is gone with it
        fault.notes.append(f"node{self.cluster.add_node()} joins with spares")


def _kill(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _cluster(work: Path, iters: int) -> LocalCluster:
    cluster = LocalCluster(NODES, PROCS, _job_args(work, iters), recovery="inprocess", spares_per_node=1,
                           spare_nodes=1, respawn=True, hang_timeout_s=HANG_TIMEOUT_S)
    cluster.start()
    return cluster


def _finish(cluster: LocalCluster, timeout_s: float) -> int:
    try:
        return cluster.wait(fail_grace_s=30.0, timeout_s=timeout_s)
    finally:
        for agent in cluster.agents:
            if agent.poll() is None:
                _signal_group(agent.pid)


def run_storm(work: Path, iters: int, settings: dict, timeout_s: float) -> tuple[int, Storm]:
    """The job under the storm: relaunched (up to ``MAX_RELAUNCHES`` times) when a launch ended before the job
    finished (a fault that could not be recovered in place: every rank lost at once), as a scheduler would;
    its final status."""
    watcher = Watcher(work / "run")
    storm = Storm(_cluster(work, iters), watcher, random.Random(settings["seed"]), faults=settings["faults"],
                  interval_s=settings["interval_s"], iters=iters, classes=CLASSES)
    for loop in (watcher.run, storm.run):
        threading.Thread(target=loop, daemon=True).start()
    try:
        status = _finish(storm.cluster, timeout_s)
        while status != 0 and _unfinished(work, iters) and storm.relaunches < MAX_RELAUNCHES:
            storm.relaunched(_cluster(work, iters))
            status = _finish(storm.cluster, timeout_s)
    finally:
        storm.done.set()
        watcher.done.set()
        watcher.read()
    return status, storm


def _signal_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _unfinished(work: Path, iters: int) -> bool:
    summary = _summary(work)
    return summary is None or summary.get("step") != iters


def _summary(work: Path) -> Optional[dict]:
    found = [r for r in metrics(work) if r.get("event") == "summary"]
    return found[-1] if found else None


def _after(recoveries: list[tuple[float, dict]], fault: Fault) -> Optional[tuple[float, dict]]:
    """The first recovery record that appeared after ``fault`` struck: its time and the record."""
    return next(((seen, r) for seen, r in recoveries if seen > fault.at), None)


def report(storm: Storm, work: Path, reference: dict, status: int) -> tuple[str, bool]:
    summary = _summary(work) or {}
    records = storm.watcher.recoveries
    rows = [f"{'#':>3} {'class':<8} {'member':<16} {'at step':>7} {'kill->step s':>12} {'rerun':>5}  notes"]
    by_class: dict[str, list[int]] = {}
    totals = []
    for f in storm.faults:
        found = _after(records, f)
        total = None if found is None else found[0] - f.at
        rerun = None if found is None else found[1].get("recovery_steps_rerun", 0)
        if total is not None:
            totals.append(total)
            by_class.setdefault(f.kind, []).append(rerun)
        rows.append(f"{f.index:>3} {f.kind:<8} {f.member:<16} {f.step!s:>7} "
                    f"{'-' if total is None else f'{total:.2f}':>12} {'-' if rerun is None else rerun:>5}  "
                    f"{'; '.join(f.notes)}")
    exact = status == 0 and summary.get("state_digest") == reference.get("state_digest")
    rows.append(f"storm: {len(storm.faults)} faults, {len(records)} recoveries, {storm.relaunches} "
                f"relaunches, exit {status}, state_digest "
                f"{summary.get('state_digest')} ({'equal to' if exact else 'DIFFERS from'} the fault-free "
                f"{reference.get('state_digest')})")
    rows.append(_goodput_line("storm", summary) + " | " + _goodput_line("fault-free", reference))
    if totals:
        ordered = sorted(totals)
        p90 = ordered[max(0, -(-9 * len(ordered) // 10) - 1)]
        rows.append(f"kill to the first step after it: {len(totals)} faults, median {statistics.median(totals):.2f} s, "
                    f"p90 {p90:.2f} s, max {max(totals):.2f} s")
    rows.append("steps rerun per fault: " + ", ".join(
        f"{k} {len(v)} faults, median {statistics.median(v):g}, max {max(v)}" for k, v in sorted(by_class.items())))
    rows.append("RESULT: " + ("bit-identical to the fault-free run" if exact else "FAILED"))
    return "\n".join(rows), exact


def _goodput_line(name: str, summary: dict) -> str:
    wall = summary.get("goodput_wall_s") or 0.0
    parts = {k[len("goodput_"):-2]: v for k, v in summary.items() if k.startswith("goodput_") and k.endswith("_s")
             and k != "goodput_wall_s"}
    split = ", ".join(f"{k} {v:.1f}" for k, v in parts.items() if v)
    return f"{name} goodput {summary.get('goodput', 0.0):.4f} of {wall:.0f} s ({split})"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", type=int, default=10)
    p.add_argument("--interval-s", type=float, default=30.0, help="mean seconds between strikes")
    p.add_argument("--iters", type=int, default=600, help="the job's train.iters (long enough for the faults)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", help="where the jobs go (default: a new temp dir)")
    p.add_argument("--timeout-s", type=float, default=7200.0)
    p.add_argument("--reference", help="the work dir of an earlier fault-free run of the same --iters (its "
                                       "'reference' folder): compared with, not run again")
    args = p.parse_args(argv)
    _environment()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="megatier_storm_")).resolve()
    started = time.monotonic()
    reference_dir = Path(args.reference).resolve() if args.reference else work / "reference"
    if not args.reference:
        status = _finish(_cluster(reference_dir, args.iters), args.timeout_s)
        shutil.rmtree(reference_dir / "shm", ignore_errors=True)
        print(f"storm: the fault-free run took {time.monotonic() - started:.0f} s (exit {status})", file=sys.stderr,
              flush=True)
    reference = _summary(reference_dir)
    if reference is None or reference.get("step") != args.iters:
        print(f"storm: no fault-free run of {args.iters} steps in {reference_dir}", file=sys.stderr)
        return 1
    status, storm = run_storm(work / "storm", args.iters,
                              {"seed": args.seed, "faults": args.faults, "interval_s": args.interval_s}, args.timeout_s)
    shutil.rmtree(work / "storm" / "shm", ignore_errors=True)
    text, exact = report(storm, work / "storm", reference, status)
    print(text)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
