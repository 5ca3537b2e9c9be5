"""A seeded fault campaign: one job through a sequence of injected faults, then the checks that matter.

    python tools/chaos/campaign.py --spec campaign.json        # or --faults 100 --seed 7

The job (lossless diffs, so recovery must be bit-exact) runs on simulated nodes
with Tier-3 on S3 (moto's server behind :mod:`tools.chaos.s3_proxy`). Each
fault gets one launch: the launch resumes from the recovery point, the fault
strikes (see :mod:`tools.chaos.catalogue`), a carrier kills the launch at its
step, and the next launch must recover. A last launch finishes the job; a
fault-free reference run in its own directories gives the digest to match.

Checked, and printed with a table of every fault: the final state is
bit-identical to the reference; the newest committed base on Tier-3 never goes
back (except where a fault destroyed it); every launch ends within its time
limit (no hang); every fault is survived (the next launch recovers and trains
on) or reported by the failing launch with a clear first error line.

With ``--recovery inprocess`` the job runs on ``megatier-agent`` nodes with a
spare on every node and a node of spares, and each launch trains only a few
steps past its fault: a fault the survivors recover in place ends that launch
with exit 0 (its recovery is the launch's own, the table says "in place");
one they cannot (every rank lost at once, a step that crashes on every rank)
ends it with a non-zero status and the next launch recovers it ("exit N +
relaunch"). A node fault kills the node's agent, ranks and spares at once.

Spec (JSON): {"seed", "faults", "types" (names from the catalogue; default all),
"nodes", "procs_per_node", "overrides" (Hydra), "gap" ([min, max] steps per
launch), "launch_timeout_s", "recovery" ("relaunch" or "inprocess")}. Exit
status 0 when every check passed.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import subprocess
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
from megatier.drill.job import first_error, make_job, read_metrics, trainer_command  # noqa: E402
from tools.chaos.catalogue import CATALOGUE, Damage, FaultType  # noqa: E402
from tools.chaos.s3_proxy import S3FaultProxy  # noqa: E402

LOOP_LIMIT = 2  # reliability.loop_limit's default: a recurring crash strikes this many launches
BASE_OVERRIDES = ["model=tiny", "train.micro_batch_size=2", "checkpoint.base_interval=10",
                  "checkpoint.diff.compression=fp32", "parallel.timeout_s=20", "checkpoint.remote.lease_s=5",
                  "checkpoint.remote.drain_timeout_s=20", "optim.decay_iters=1000", "train.eval_interval=1000000"]


@dataclass
class Event:
    index: int
    fault: FaultType
    step: int  # the launch's carrier step (the fault's crash point is armed from here)
    victim: int  # node index
    launch_exit: Optional[int] = None
    launch_s: float = 0.0
    reached: Optional[int] = None  # last step the launch logged
    detail: str = ""
    recovery: Optional[dict] = None  # the recovery record of this fault (in place: its own launch's)
    in_place: bool = False  # recovered by its own launch's survivors (--recovery inprocess)
    restored_first: bool = False  # its first launch restored a point (a recurring crash then loops on it)
    problems: list[str] = field(default_factory=list)


class Campaign:
    def __init__(self, spec: dict, work: str):
        self.spec, self.work = spec, work
        self.rng = random.Random(spec.get("seed", 0))
        self.nodes, self.procs = spec.get("nodes", 2), spec.get("procs_per_node", 1)
        self.timeout_s = spec.get("launch_timeout_s", 240)
        self.inprocess = spec.get("recovery", "relaunch") == "inprocess"
        self.proxy = self.server = None
        self.newest_committed: Optional[int] = None
        self.events = self._plan()
        self.iters = self.events[-1].step + 8 if self.events else 20

    def _plan(self) -> list[Event]:
        names = self.spec.get("types") or list(CATALOGUE)
        if self.nodes < 2:
            names = [n for n in names if n not in ("node", "t2 flip")]
        lo, hi = self.spec.get("gap", [4, 9])
        events, step = [], 4
        for i in range(self.spec.get("faults", 10)):
            # Every type once in a shuffled round, then again: a campaign covers each type it can.
            if i % len(names) == 0:
                order = self.rng.sample(names, len(names))
            fault = CATALOGUE[order[i % len(names)]]
            # A lease conflict needs its launch alive while the second one starts: many steps (seconds).
            step += self.rng.randint(lo, hi) + (400 if fault.lease_conflict else 0)
            events.append(Event(i + 1, fault, step, self.rng.randrange(self.nodes)))
        return events

    # ---- the job --------------------------------------------------------------------------------

    def _start_s3(self) -> list[str]:
        import boto3
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request otherwise
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
        boto3.client("s3", endpoint_url=f"http://{host}:{port}").create_bucket(Bucket="campaign")
        self.proxy = S3FaultProxy(f"http://{host}:{port}", seed=self.spec.get("seed", 0)).start()
        return ["checkpoint.remote.url=s3://campaign/runs", f"checkpoint.remote.endpoint_url={self.proxy.url}"]

    def _store(self):
        from megatier.checkpoint.tiers.remote import open_remote_store

        return open_remote_store("s3://campaign/runs", self.job.job_id, endpoint_url=self.server_url())

    def server_url(self) -> str:
        host, port = self.server.get_host_and_port()
        return f"http://{host}:{port}"

    def _launch(self, name: str, *, env: dict, file_limit: dict, s3_rule=None, iters: Optional[int] = None) -> int:
        """One launch of the job (``iters``: trained only that far, in process: a few steps past its fault)."""
        log_path = os.path.join(self.job.work, f"{name}.log")
        overrides = [o for o in self.job.overrides if not (iters and o.startswith("train.iters="))]
        script = trainer_command(overrides + ([f"train.iters={iters}"] if iters else []))
        spares = {"recovery": "inprocess", "spares_per_node": 1, "spare_nodes": 1} if self.inprocess else {}
        self._mark = len(read_metrics(self.job, every_launch=True))
        with open(log_path, "w") as log:
            saved = os.dup(1), os.dup(2)
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                cluster = LocalCluster(self.nodes, self.procs, script, node_env=env, node_file_limit=file_limit,
                                       **spares)
                cluster.start()
                if s3_rule is not None:  # Tier-3 misbehaves once the launch trains (start-up needs it usable)
                    threading.Thread(target=self._disturb_s3, args=(s3_rule,), daemon=True).start()
                return cluster.wait(fail_grace_s=5.0, timeout_s=self.timeout_s)
            finally:
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0])
                os.close(saved[1])

    def _disturb_s3(self, rule) -> None:
        """Set the proxy's rule once the running launch has logged a step (its metrics file is new)."""
        start = len(read_metrics(self.job))
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            records = read_metrics(self.job)
            if any("loss" in r for r in records) and len(records) != start:
                self.proxy.set_rule(rule)
                return
            time.sleep(0.1)

    def _lease_conflict(self, event: Event) -> threading.Thread:
        """Start a second launch of the job (another run directory, same job id and tiers) while this one runs;
        it must refuse to start, naming the first."""
        log_path = os.path.join(self.job.work, f"launch{event.index}-second.log")

        def second() -> None:
            time.sleep(6.0)
            cmd = [sys.executable, "-m", "megatier.cli.launch", "--nodes", str(self.nodes), "--procs-per-node",
                   str(self.procs), "--fail-grace-s", "5", "--",
                   *trainer_command([*self.job.overrides, f"logging.run_dir={self.job.work}/second-run"])]
            with open(log_path, "w") as log:
                status = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=self.timeout_s,
                                        cwd=REPO).returncode
            if status == 0 or "in use by a live run" not in open(log_path, errors="replace").read():
                event.problems.append(f"a second live launch was not refused (exit {status}; {log_path})")
            else:
                event.detail = "a second launch was refused: in use by a live run"

        thread = threading.Thread(target=second, daemon=True)
        thread.start()
        return thread

    # ---- one fault ------------------------------------------------------------------------------

    def _env(self, event: Event) -> dict[int, dict[str, str]]:
        f = event.fault
        # In process, a lost node takes its agent, ranks and spares at once (the process group of the node).
        carrier = f"train.step_end:{event.step}" + (":node" if self.inprocess and f.wipe else "")
        armed = {i: [] for i in range(self.nodes)}
        for i in (range(self.nodes) if f.carrier_everywhere else [event.victim]):
            armed[i].append(carrier)
        if f.crash_point:
            at = 0 if f.crash_point == "replay.mid_batch" else event.step - 2
            for i in range(self.nodes):
                armed[i].insert(0, f"{f.crash_point}:{at}")
        if f.hang:  # one process stops itself: its peers fail on their timeout, or in process its agent kills it
            armed = {i: [f"train.step_end:{event.step + 40}"] for i in range(self.nodes)}
            armed[event.victim].insert(0, f"train.step_end:{event.step}:stop")
        if f.recurring:  # the step dies as it begins, on every node, whatever point the launch restored
            for i in range(self.nodes):
                armed[i].insert(0, f"train.step_begin:{event.step}")
        env = {i: {"MEGATIER_CRASH_AT": ",".join(a)} for i, a in armed.items() if a}
        if f.transient:  # two steps before the carrier, on the victim node's first rank
            env.setdefault(event.victim, {})[f.transient] = f"{event.step - 2}:{event.victim * self.procs}"
        return env

    def _damage(self, event: Event) -> None:
        if event.fault.damage is None:
            return
        d = Damage(os.path.join(self.job.local_root, self.job.job_id), self._store(), f"node{event.victim}",
                   self.rng)
        what = event.fault.damage(d)
        event.detail = f"damaged {what}" if what else "nothing to damage yet"

    def _wipe(self, event: Event) -> None:
        nodes = range(self.nodes) if event.fault.wipe == "rack" else [event.victim]
        for i in nodes:
            shutil.rmtree(os.path.join(self.job.local_root, self.job.job_id, f"node{i}"), ignore_errors=True)

    def run_event(self, event: Event) -> None:
        f = event.fault
        self._damage(event)
        second = self._lease_conflict(event) if f.lease_conflict else None
        t0 = time.monotonic()
        for again in range(LOOP_LIMIT if f.recurring else 1):  # a recurring crash strikes launch after launch
            event.launch_exit = self._launch(f"launch{event.index}" + (f"-{again}" if again else ""),
                                             env=self._env(event),
                                             file_limit={event.victim: f.file_limit} if f.file_limit else {},
                                             s3_rule=f.s3(event.victim * self.procs) if f.s3 is not None else None,
                                             iters=event.step + 3 if self.inprocess else None)
            if again == 0:
                self._check_transient(event)
                event.restored_first = any(r.get("event") == "recovery" for r in self._records())
            if self.inprocess and again == 0 and event.launch_exit == 0:
                event.in_place, event.recovery = True, self._own_recovery(event)
                break
        event.launch_s = time.monotonic() - t0
        self.proxy.clear()
        if second is not None:
            second.join(self.timeout_s)
        reached = [r["step"] for r in self._records() if "loss" in r and r.get("event") is None]
        event.reached = reached[-1] if reached else None
        if event.launch_exit == 124:
            event.problems.append(f"launch {event.index} hung past {self.timeout_s} s")
        elif event.in_place and event.recovery is None and not f.transient:
            event.problems.append(f"launch {event.index} exited 0 without recovering from its fault in place")
        elif event.launch_exit == 0 and not self.inprocess:
            event.problems.append(f"launch {event.index} was to be killed at step {event.step} but finished")
        if f.wipe:
            self._wipe(event)
        self._check_committed(event)

    def _records(self) -> list[dict]:
        """The last launch's metrics records, also those a new rank 0 in place wrote to a file of its own."""
        return read_metrics(self.job, every_launch=True)[self._mark:]

    def _own_recovery(self, event: Event) -> Optional[dict]:
        """The in-place recovery record of ``event``'s launch: the last one after its first trained step."""
        records = self._records()
        first_step = next((i for i, r in enumerate(records) if "loss" in r and r.get("event") is None), len(records))
        own = [r for r in records[first_step:] if r.get("event") == "recovery"]
        return own[-1] if own else None

    def _check_transient(self, event: Event) -> None:
        """A transient fault must be caught by its step's rerun (and the run go on with the second result)."""
        if not event.fault.transient:
            return
        reruns = [r for r in self._records() if r.get("event") == "rerun"]
        if any(r["step"] == event.step - 2 and r["transient"] for r in reruns):
            event.detail = f"step {event.step - 2} rerun: a transient fault on rank(s) {reruns[-1]['ranks']}"
        else:
            event.problems.append(f"the transient fault at step {event.step - 2} was not caught (reruns: {reruns})")

    def _check_committed(self, event: Event) -> None:
        """The newest committed base on Tier-3 never goes back, unless this fault destroyed Tier-3 data or the
        restart-loop guard took an older point on purpose."""
        from megatier.checkpoint.commit.records import list_units

        bases = [p.version for p, u in list_units(self._store()).items() if u.committed and p.kind == "base"]
        newest = max(bases, default=None)
        restored = next((r for r in self._records() if r.get("event") == "recovery"), {})
        if self.newest_committed is not None and (newest is None or newest < self.newest_committed) \
                and not restored.get("fallback"):
            if event.fault.damage is None or not event.fault.name.startswith(("t3", "commit")):
                event.problems.append(f"the newest committed base went back from v{self.newest_committed} to "
                                      f"v{newest}")
        self.newest_committed = newest

    # ---- the whole campaign ---------------------------------------------------------------------

    def run(self) -> int:
        overrides = BASE_OVERRIDES + self._start_s3() + list(self.spec.get("overrides", []))
        self.job = make_job(os.path.join(self.work, "job"), overrides + [f"train.iters={self.iters}"])
        os.makedirs(self.job.work, exist_ok=True)
        pending: list[Event] = []
        for event in self.events:
            self.run_event(event)
            self._assign_recovery(pending, exclude=event)
            if not event.in_place:
                pending.append(event)
            print(f"campaign: {event.index}/{len(self.events)} {event.fault.name} at step {event.step} on "
                  f"node{event.victim}: exit {event.launch_exit}, reached {event.reached}", file=sys.stderr)
        final_status = self._launch("finish", env={}, file_limit={})
        self._assign_recovery(pending, exclude=None)
        final = next((r for r in reversed(read_metrics(self.job)) if r.get("event") == "summary"), {})
        reference = self._reference()
        problems = self._problems(final_status, final, reference)
        print(self.report(final, final_status, reference, problems))
        self.server.stop()
        self.proxy.stop()
        return 0 if not problems else 1

    def _assign_recovery(self, pending: list[Event], exclude: Optional[Event]) -> None:
        record = next((r for r in self._records() if r.get("event") == "recovery"), None)
        if record is None:
            return
        for event in [e for e in pending if e is not exclude and e.recovery is None]:
            event.recovery = record

    def _reference(self) -> dict:
        ref = make_job(os.path.join(self.work, "reference"), self.job.overrides, isolated=True)
        os.makedirs(ref.work, exist_ok=True)
        saved, self.job = self.job, ref
        try:
            self._launch("reference", env={}, file_limit={})
            return next((r for r in reversed(read_metrics(ref)) if r.get("event") == "summary"), {})
        finally:
            self.job = saved

    def _problems(self, final_status: int, final: dict, reference: dict) -> list[str]:
        problems = [f"fault {e.index} ({e.fault.name}): {p}" for e in self.events for p in e.problems]
        for e in self.events:
            # Only a crash that follows a restored point makes a loop; one in a job's first launch follows none.
            if e.fault.recurring and e.restored_first and e.recovery is not None and not e.recovery.get("fallback"):
                problems.append(f"fault {e.index} ({e.fault.name}): the launch after it restored the newest point "
                                f"again instead of falling back (restart-loop guard)")
            if e.recovery is None:
                problems.append(f"fault {e.index} ({e.fault.name}): no later launch recovered from it; first error "
                                f"of its launch: {first_error(os.path.join(self.job.work, f'launch{e.index}.log'))}")
        if final_status != 0 or final.get("step") != self.iters:
            problems.append(f"the job did not finish: exit {final_status}, last summary step {final.get('step')}")
        if final.get("state_digest") != reference.get("state_digest"):
            problems.append(f"final state {final.get('state_digest')} differs from the fault-free run's "
                            f"{reference.get('state_digest')} (lossless diffs must be bit-identical)")
        return problems

    def report(self, final: dict, final_status: int, reference: dict, problems: list[str]) -> str:
        head = (f"{'#':>3} {'fault':<34} {'node':<5} {'step':>4} {'exit':>4} {'reached':>7} {'V->E':>9} "
                f"{'bases from':<18} {'lost':>4} {'restore s':>9} {'launch s':>8}  detail")
        lines = [f"fault campaign: {len(self.events)} faults, {len({e.fault.name for e in self.events})} types, "
                 f"{self.nodes} nodes x {self.procs} processes, job {self.job.job_id!r} ({self.iters} steps, lossless "
                 f"diffs, Tier-3 on S3 behind a fault proxy); logs in {self.job.work}", head]
        for e in self.events:
            r = e.recovery or {}
            ve = f"{r.get('version')}->{r.get('end')}" if r else "-"
            sources = ",".join(f"{k[-1]}:{v}" for k, v in (r.get("source_tiers") or {}).items() if v) or "-"
            restore = sum(r.get(k, 0.0) for k in ("t_consensus_s", "t_rollback_s", "t_replay_s")) if r else 0.0
            lost = r.get("steps_lost") if r.get("steps_lost") is not None else "-"
            detail = "; ".join(e.problems) or e.detail
            lines.append(f"{e.index:>3} {e.fault.name:<34} {e.victim:<5} {e.step:>4} {e.launch_exit!s:>4} "
                         f"{e.reached!s:>7} {ve:>9} {sources:<18} {lost!s:>4} {restore:>9.3f} {e.launch_s:>8.1f}  "
                         f"{detail}")
        lines += self.by_type()
        survived = sum(1 for e in self.events if e.recovery is not None and not e.problems)
        ours, theirs = final.get("state_digest"), reference.get("state_digest")
        lines.append(f"totals: {survived}/{len(self.events)} faults recovered as required; final step "
                     f"{final.get('step')} (exit {final_status}) state_digest {ours} vs fault-free {theirs} -> "
                     f"{'bit-identical' if ours == theirs else 'DIFFERENT'}")
        lines += [f"FAILED CHECK: {p}" for p in problems]
        lines.append("RESULT: " + ("every fault survived or reported; no committed version lost; no hang"
                                   if not problems else "the campaign found problems"))
        return "\n".join(lines)


    def by_type(self) -> list[str]:
        """One row per fault type: how often it struck, how its recoveries went (mode: a relaunch, or the step's
        rerun in process for a transient fault; the fallback of the restart-loop guard), steps lost, MiB read from
        each tier, and the wall time of its launches."""
        rows = [f"{'fault type':<34} {'count':>5} {'ok':>3} {'mode':<26} {'classes':<22} {'lost':>5} "
                f"{'MiB t1/t2/t3':>16} {'wall s':>7}"]
        for name in sorted({e.fault.name for e in self.events}):
            events = [e for e in self.events if e.fault.name == name]
            records = [e.recovery for e in events if e.recovery]
            ok = sum(1 for e in events if e.recovery is not None and not e.problems)
            placed = sum(1 for e in events if e.in_place)
            modes = [f"in place {placed}"] if placed else []
            if placed < len(events):
                statuses = ",".join(sorted({str(e.launch_exit) for e in events if not e.in_place}))
                modes.append(("relaunch" if not self.inprocess else f"exit {statuses} + relaunch")
                             + (", fallback" if any(r.get("fallback") for r in records) else ""))
            if events[0].fault.transient:
                modes.insert(0, "rerun")
            classes = ",".join(sorted({r.get("failure_class") or "-" for r in records})) or "-"
            lost = [r["steps_lost"] for r in records if r.get("steps_lost") is not None]
            span = f"{min(lost)}-{max(lost)}" if lost else "-"
            mib = "/".join(f"{sum(r.get(f'bytes_tier{t}', 0) for r in records) / 2**20:.1f}" for t in (1, 2, 3))
            rows.append(f"{name:<34} {len(events):>5} {ok:>3} {' + '.join(modes):<26} {classes:<22} {span:>5} "
                        f"{mib:>16} {sum(e.launch_s for e in events):>7.1f}")
        return ["by fault type (recoveries are those of the launch after each fault):", *rows]


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", help="JSON spec (see the module docstring); flags below override it")
    p.add_argument("--faults", type=int, help="how many faults")
    p.add_argument("--seed", type=int, help="the schedule's seed")
    p.add_argument("--types", help="comma-separated fault types (default: every type)")
    p.add_argument("--nodes", type=int)
    p.add_argument("--procs-per-node", type=int)
    p.add_argument("--recovery", choices=("relaunch", "inprocess"), help="how each fault is recovered (default: "
                   "relaunch; inprocess: survivors and spares in the same launch)")
    p.add_argument("--work-dir", help="where the job, its tiers and logs go (default: a new temp dir)")
    p.add_argument("--list", action="store_true", help="print the fault types and exit")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if args.list:
        for f in CATALOGUE.values():
            print(f"{f.name:<36} {f.what}")
        return 0
    spec = json.loads(Path(args.spec).read_text()) if args.spec else {}
    for key in ("faults", "seed", "nodes", "recovery"):
        if getattr(args, key) is not None:
            spec[key] = getattr(args, key)
    if args.procs_per_node is not None:
        spec["procs_per_node"] = args.procs_per_node
    if args.types:
        spec["types"] = [t.strip() for t in args.types.split(",")]
    unknown = [t for t in spec.get("types", []) if t not in CATALOGUE]
    if unknown:
        raise SystemExit(f"campaign: unknown fault types {unknown}; see --list")
    work = os.path.abspath(args.work_dir or tempfile.mkdtemp(prefix="megatier_campaign_"))
    return Campaign(spec, work).run()


if __name__ == "__main__":
    sys.exit(main())
