"""Failure drill: inject a software, node or rack failure into a job on a simulated cluster and check recovery.

    megatier-drill --nodes 2 --procs-per-node 2 --fail node --at-step 17 --compare -- \\
        model=tiny parallel.tp=2 train.iters=30 checkpoint.base_interval=20 checkpoint.diff.compression=fp32

The job runs with all three checkpoint tiers (``checkpoint=tiered`` unless the
overrides pick another checkpoint preset) on ``--nodes`` simulated nodes, one
torchrun agent each (:mod:`megatier.cli.launch`), with its Tier-3 directory,
run directory and logs under ``--work-dir`` and its node memory (Tier-1 and
Tier-2) in /dev/shm as in a real run (:func:`node_memory_root`; freed when the
drill exits). For each step S of ``--at-step`` the drill:

  software  arms the ``train.step_end`` crash point at S on the processes of one
            node (``--victim``, default the last): they SIGKILL themselves right after
            step S, the launcher stops the others, and the job is relaunched on the
            same nodes, Tier-1 memory intact;
  node      the same kill, then wipes the victim node's Tier-1 area (its memory is
            gone) and relaunches with a replacement node of the same name;
  rack      kills every process at S, wipes every node's Tier-1 area, relaunches.
  stage     kills the ranks of pipeline stage ``--stage`` at S and wipes every copy
            of their units (their Tier-1 areas, their replicas on other nodes, their
            Tier-3 objects; the commit records stay, as when objects go missing), then
            relaunches with ``checkpoint.last_resort=checkfree`` (unless the overrides
            set another): the stage is rebuilt from its neighbours, not exactly.

With ``--no-spare`` (node failures) no replacement arrives: the job carries on
on the surviving nodes with a smaller dp. Its restore reshards the state (the
lost node's ranks from their Tier-2 replicas on the survivors, the others from
Tier-1, nothing from Tier-3), and the job trains on to ``train.iters``.

The relaunched job recovers (its ``restore()``) and trains on to ``train.iters``.
The drill then reads each recovery record from the run's metrics.jsonl and
checks it against what the class requires:

  software  every rank served from its own node's memory (Tier-1), zero bytes from
            Tier-3, at most one step lost (one diff batch without diff.per_step);
  node      the victim node's ranks from Tier-2 (their replicas on the ring peer),
            every other rank from Tier-1, zero bytes from Tier-3, at most two steps
            lost (one diff batch without diff.per_step);
  rack      every rank from Tier-3.
  stage     a CheckFree rebuild of exactly that stage, saying it is not exact; the
            other ranks from their own Tier-1, at most one step lost.
  no spare  as node, old ranks counted on the nodes they ran on, and the
            record must say what was resharded.

With ``--compare`` it also runs the same job without a failure (in its own
directories) and compares the final ``state_digest``: with lossless diffs
(``checkpoint.diff.compression=fp32``) the two must be bit-identical; with lossy
ones the report gives the final-loss difference instead (always for a stage
failure: a rebuilt stage is not the state it lost). The exit status is 0
when every check passed, 1 when recovery did not happen as the class requires
(the report says which check failed), 2 for bad arguments. Under ``--no-spare`` the
relaunched job trains with another dp, so its final state cannot equal the
fault-free run's; ``--compare`` then runs the fault-free job to the recovery
point E and compares the layout-free canonical digest of the state there with
the one the resharded restore recorded (bit-identical with lossless diffs).
At the end the drill draws the run's pictures next to its metrics (the
figures of ``megatier-plot``: loss with the failures marked, stall, recovery
points, tier bytes).

Which S to pick: the newest base a node failure can recover from Tier-2 is the
newest whose replica finished its paced transfer (about 4/5 of a base interval
after the base), so an S late in a base interval exercises Tier-2; earlier, the
newest base is already committed on Tier-3 and the victim's ranks rightly read
it from there (the report says so).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from megatier.cli.drill_report import (
    CLASSES,
    Recovery,
    check_recovery,
    final_problems,
    format_report,
    goodput_fields,
    stall_summary,
    victims,
)
from megatier.cli.launch import LocalCluster
from megatier.config import split_overrides
from megatier.faults import CrashPoint
from megatier.observe.plot import write_plots
from megatier.observe.run_history import MetricsMissing

REPO = Path(__file__).resolve().parents[2]  # pretrain_gpt.py lives at the repository root


@dataclass
class Job:
    """Where one job lives and what the drill needs to know of its config."""

    work: str
    overrides: list[str]
    job_id: str = ""
    local_root: str = ""
    run_dir: str = ""
    iters: int = 0
    batch: int = 0
    compression: str = ""
    per_step: bool = True
    decay_iters: int = 0  # the LR schedule's horizon (a reference run stopped early keeps it)
    remote_root: str = ""  # the job's Tier-3 directory
    tp: int = 1
    pp: int = 1

    @property
    def tier1_root(self) -> str:
        return os.path.join(self.local_root, self.job_id)

    def node_area(self, node: str) -> str:
        return os.path.join(self.tier1_root, node)


def node_memory_root(work: str) -> str:
    """Where a drill keeps the job's node memory: in /dev/shm, as a real run does (node memory on a disk stalls
    its writes, the ring's replicas too, behind page-cache writeback), one directory per work directory; under
    the work directory where there is no writable /dev/shm."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK):
        tag = hashlib.sha1(os.path.abspath(work).encode()).hexdigest()[:12]
        return os.path.join(shm, "megatier-drill", tag)
    return os.path.join(work, "shm")


def make_job(work: str, user_overrides: list[str], *, isolated: bool = False, memory_root: Optional[str] = None,
             extra: Sequence[str] = ()) -> Job:
    """The job's overrides and the resolved config: the drill's directories first and the user's win, or with
    ``isolated`` (the fault-free reference) the drill's directories and job id last, so the reference never
    shares a tier with the drilled run whatever the user overrides. Node memory goes to ``memory_root``
    (default: under the work directory); ``extra`` overrides go before the user's (the class's defaults)."""
    from megatier.config import compose_config

    ours = [f"checkpoint.local.root={memory_root or os.path.join(work, 'shm')}", f"checkpoint.remote.url={work}/remote",
            f"logging.run_dir={work}/run", f"checkpoint.job_id={'reference' if isolated else 'drill'}",
            "logging.progress=false", *extra] + (["checkpoint.remote.endpoint_url=null"] if isolated else [])
    preset = [] if any(o.lstrip("+~").startswith("checkpoint=") for o in user_overrides) else ["checkpoint=tiered"]
    overrides = preset + (list(user_overrides) + ours if isolated else ours + list(user_overrides))
    cfg = compose_config(overrides)
    c = cfg.checkpoint
    if not c.enabled:
        raise SystemExit("failure_drill: the overrides turn checkpointing off (checkpoint.enabled=false); a drill "
                         "needs it on")
    return Job(work, overrides, c.job_id, c.local.root, cfg.logging.run_dir, cfg.train.iters, c.diff.batch,
               c.diff.compression, c.diff.per_step, cfg.optim.decay_iters or cfg.train.iters,
               os.path.join(c.remote.url, c.job_id), cfg.parallel.tp, cfg.parallel.pp)


def launch(args, job: Job, log_name: str, node_env: Optional[dict] = None, nodes: Optional[int] = None) -> int:
    """Run the job once on the simulated cluster (``nodes``, default ``--nodes``); output goes to
    ``<work>/<log_name>.log``."""
    log_path = os.path.join(job.work, f"{log_name}.log")
    script = [str(REPO / "pretrain_gpt.py"), *job.overrides]
    nodes = nodes or args.nodes
    # Progress on stderr: the launches take minutes and their own output goes to the log.
    print(f"failure_drill: {log_name} on {nodes} x {args.procs_per_node} processes (log {log_path})",
          file=sys.stderr, flush=True)
    with open(log_path, "w") as log:
        saved = os.dup(1), os.dup(2)
        os.dup2(log.fileno(), 1)  # the agents inherit the drill's stdout/stderr
        os.dup2(log.fileno(), 2)
        try:
            cluster = LocalCluster(nodes, args.procs_per_node, script, node_env=node_env)
            cluster.start()
            return cluster.wait(fail_grace_s=args.fail_grace_s, timeout_s=args.timeout_s)
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


_ERROR_LINE = re.compile(r"^(config error: .*|\S*(Error|Exception): .*)$")


def first_error(log_path: str) -> str:
    """The first error line of a launch's log (e.g. "config error: ..."), or a note that there is none."""
    try:
        with open(log_path, errors="replace") as f:
            for line in f:
                line = re.sub(r"^\[(default)?\d+\]:", "", line.strip()).strip()  # torchrun's rank prefixes
                if _ERROR_LINE.match(line):
                    return line
    except OSError:
        return "no log"
    return "no error line in its log"


def read_metrics(job: Job, every_launch: bool = False) -> list[dict]:
    """The current launch's metrics records; ``every_launch``: also those of the launches before it, which the
    logger kept as metrics.<n>.jsonl."""
    names = ["metrics.jsonl"]
    if every_launch and os.path.isdir(job.run_dir):
        names += [n for n in os.listdir(job.run_dir) if n.startswith("metrics.") and n != "metrics.jsonl"]
    out = []
    for name in names:
        path = os.path.join(job.run_dir, name)
        if os.path.exists(path):
            with open(path) as f:
                out += [json.loads(line) for line in f if line.strip()]
    return out


def stage_ranks(args, job: Job) -> list[int]:
    """The global ranks of pipeline stage ``--stage`` (the rank formula: tp fastest, then dp, then pp)."""
    per_stage = args.nodes * args.procs_per_node // job.pp
    return list(range(args.stage * per_stage, (args.stage + 1) * per_stage))


def wipe_ranks(job: Job, ranks: list[int]) -> list[str]:
    """Delete every copy of ``ranks``' units: their own Tier-1 areas and replicas on every node and their Tier-3
    objects (commit records kept: the objects went missing). Returns what was deleted."""
    gone = []
    for r in ranks:
        name = f"rank{r:05d}"
        areas = [os.path.join(job.tier1_root, node, kind, name) for node in
                 (os.listdir(job.tier1_root) if os.path.isdir(job.tier1_root) else []) for kind in ("own", "replica")]
        for path in [a for a in areas if os.path.isdir(a)]:
            shutil.rmtree(path)
            gone.append(path)
        for path in Path(job.remote_root).glob(f"*/*/{name}.*"):
            path.unlink()
            gone.append(str(path))
    return gone


def inject(args, job: Job, at_step: int, k: int) -> int:
    """Launch with the crash point armed at ``at_step`` on the victims; then wipe what the class loses."""
    if args.fail == "stage":
        ranks = stage_ranks(args, job)
        armed = ",".join(f"{CrashPoint.TRAIN_STEP_END}:{at_step}:{r}" for r in ranks)
        env = {i: {"MEGATIER_CRASH_AT": armed} for i in range(args.nodes)}
    else:
        env = {i: {"MEGATIER_CRASH_AT": f"{CrashPoint.TRAIN_STEP_END}:{at_step}"} for i in victims(args)}
    status = launch(args, job, f"launch{k}-fail-at-{at_step}", env)
    if args.fail == "stage":
        gone = wipe_ranks(job, stage_ranks(args, job))
        print(f"failure_drill: stage {args.stage} lost every copy ({len(gone)} areas and objects deleted)",
              file=sys.stderr, flush=True)
    elif args.fail in ("node", "rack"):
        for i in victims(args):
            shutil.rmtree(job.node_area(f"node{i}"), ignore_errors=True)  # the node's memory is gone
    elif args.corrupt:
        flip_newest_base_byte(job, f"node{args.victim}")
    return status


def flip_newest_base_byte(job: Job, node: str) -> str:
    """Flip one byte in the middle of the newest base in ``node``'s own Tier-1 area (first rank there)."""
    own = os.path.join(job.node_area(node), "own")
    ranks = sorted(os.listdir(own)) if os.path.isdir(own) else []
    bases = sorted(Path(own, ranks[0], "base").glob("v*.safetensors")) if ranks else []
    if not bases:
        raise SystemExit(f"failure_drill --corrupt: no base payload in {own} to corrupt")
    path = str(bases[-1])
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    print(f"failure_drill: flipped one byte of {path}", file=sys.stderr)
    return path


def run_drill(args, job: Job) -> tuple[list[Recovery], list[dict], int]:
    """Inject every failure in turn, then let the job finish; returns the recoveries and the final launch."""
    recoveries: list[Recovery] = []
    for k, at_step in enumerate(sorted(args.at_step)):
        status = inject(args, job, at_step, k)
        last = [r["step"] for r in read_metrics(job) if "loss" in r and r.get("event") is None]
        rec = Recovery(at_step, status)
        if status == 0 or not last or last[-1] != at_step:
            log_path = os.path.join(job.work, f"launch{k}-fail-at-{at_step}.log")
            rec.problems.append(f"launch {k} was to die at step {at_step} but exited {status} with its last "
                                f"logged step {last[-1] if last else None}: {first_error(log_path)}; see {log_path}")
        recoveries.append(rec)
        if recoveries[-1].problems:
            return recoveries, read_metrics(job), status
        if k > 0:
            recoveries[k - 1].record = _recovery_record(read_metrics(job))
    survivors = args.nodes - len(victims(args)) if args.no_spare else args.nodes
    status = launch(args, job, f"launch{len(recoveries)}-finish", nodes=survivors)
    final = read_metrics(job)
    recoveries[-1].record = _recovery_record(final)
    for rec in recoveries:
        check_recovery(args, job, rec)
    return recoveries, final, status


def _recovery_record(records: list[dict]) -> Optional[dict]:
    found = [r for r in records if r.get("event") == "recovery"]
    return found[0] if found else None


def _summary(records: list[dict]) -> dict:
    found = [r for r in records if r.get("event") == "summary"]
    return found[-1] if found else {}


def run_reference(args, job_overrides: list[str], stop_at: Optional[int] = None,
                  decay_iters: Optional[int] = None) -> dict:
    """The same job without a failure, in its own directories (``stop_at``: trained to that step only, with the
    LR schedule of the full job); returns its summary record."""
    if stop_at is not None:
        keys = ("train.iters=", "optim.decay_iters=")
        job_overrides = [o for o in job_overrides if not o.startswith(keys)]
        job_overrides += [f"train.iters={stop_at}", f"optim.decay_iters={decay_iters}"]
    work = os.path.join(args.work_dir, "reference")
    ref = make_job(work, job_overrides, isolated=True, memory_root=node_memory_root(work))
    os.makedirs(ref.work, exist_ok=True)
    status = launch(args, ref, "reference")
    summary = _summary(read_metrics(ref))
    if status != 0 or not summary:
        raise SystemExit(f"failure_drill: the fault-free reference run failed (exit {status}): "
                         f"{first_error(os.path.join(ref.work, 'reference.log'))}; see {ref.work}/reference.log")
    return summary


def parse_args(argv: list[str]) -> argparse.Namespace:
    argv, overrides = split_overrides(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Hydra overrides for the job go after --",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes (one torchrun agent each)")
    p.add_argument("--procs-per-node", type=int, default=2, help="training processes per node")
    p.add_argument("--fail", choices=CLASSES, required=True, help="failure class to inject")
    p.add_argument("--at-step", type=int, nargs="+", required=True, help="step(s) after which the failure strikes")
    p.add_argument("--victim", type=int, default=None, help="node index killed by a software/node failure "
                                                            "(default: the last node)")
    p.add_argument("--stage", type=int, default=None, help="stage failures: the pipeline stage whose ranks die and "
                                                           "whose units are wiped from every tier")
    p.add_argument("--corrupt", action="store_true", help="software failures: flip one byte of the victim node's "
                                                          "newest Tier-1 base before relaunching (checksum drill)")
    p.add_argument("--no-spare", action="store_true", help="node failures: no replacement node; the job carries on "
                                                            "on the survivors with a smaller dp (resharded restore)")
    p.add_argument("--compare", action="store_true",
                   help="also run fault-free and compare the final state_digest (with --no-spare: the canonical "
                        "digest at the recovery point)")
    p.add_argument("--work-dir", default=None, help="directory for tiers, runs and logs (default: a new temp dir)")
    p.add_argument("--json", default=None, help="write the report's data here as JSON")
    p.add_argument("--timeout-s", type=float, default=900.0, help="limit for each launch of the job")
    p.add_argument("--fail-grace-s", type=float, default=5.0,
                   help="after the victims die, seconds the other nodes get before they are stopped")
    args = p.parse_args(argv)
    args.overrides = overrides
    if args.nodes < 1 or args.procs_per_node < 1:
        p.error("--nodes and --procs-per-node must be >= 1")
    if args.victim is None:
        args.victim = args.nodes - 1
    if not 0 <= args.victim < args.nodes:
        p.error(f"--victim {args.victim} is not a node index in [0, {args.nodes})")
    if args.fail == "node" and args.nodes < 2:
        p.error("a node failure needs --nodes >= 2: the lost node's replicas live on its ring peer")
    if args.no_spare and (args.fail != "node" or len(args.at_step) != 1 or args.victim != args.nodes - 1):
        p.error("--no-spare goes with --fail node, one --at-step and the last node as the victim (the survivors "
                "keep their node names)")
    if (args.fail == "stage") != (args.stage is not None):
        p.error("--stage goes with --fail stage, and --fail stage needs --stage")
    if args.corrupt and args.fail != "software":
        p.error("--corrupt goes with --fail software (node and rack failures wipe the Tier-1 copy anyway)")
    if len(set(args.at_step)) != len(args.at_step) or min(args.at_step) < 1:
        p.error(f"--at-step {args.at_step}: give distinct steps >= 1")
    args.at_step = sorted(args.at_step)
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.work_dir = os.path.abspath(args.work_dir or tempfile.mkdtemp(prefix="megatier_drill_"))
    work = os.path.join(args.work_dir, "drill")
    extra = ["checkpoint.last_resort=checkfree"] if args.fail == "stage" else []
    job = make_job(work, args.overrides, memory_root=node_memory_root(work), extra=extra)
    if args.fail == "stage":
        _check_stage(args, job, work)
    if args.at_step[-1] >= job.iters:
        raise SystemExit(f"failure_drill: --at-step {args.at_step[-1]} must be below train.iters={job.iters}, "
                         f"so the job has steps left to finish after recovering")
    if os.path.exists(job.work) and os.listdir(job.work):
        raise SystemExit(f"failure_drill: {job.work} is not empty; give a fresh --work-dir (the drill never "
                         f"reuses or deletes an earlier job's checkpoints)")
    os.makedirs(job.work, exist_ok=True)
    try:
        return _drill_and_report(args, job)
    finally:  # node memory is RAM: give it back (the report, logs, metrics and Tier-3 stay in the work directory)
        for root in {node_memory_root(job.work), node_memory_root(os.path.join(args.work_dir, "reference"))}:
            if root.startswith("/dev/shm/"):
                shutil.rmtree(root, ignore_errors=True)


def _check_stage(args, job: Job, work: str) -> None:
    """A stage drill needs a pipeline with that stage and Tier-3 in the drill's own directory (it wipes it)."""
    world = args.nodes * args.procs_per_node
    if world % (job.tp * job.pp) or not 0 <= args.stage < job.pp:
        raise SystemExit(f"failure_drill: --stage {args.stage} is not a pipeline stage of parallel.pp={job.pp} "
                         f"(tp={job.tp}) on {args.nodes} x {args.procs_per_node} processes")
    if os.path.abspath(job.remote_root) != os.path.join(work, "remote", job.job_id):
        raise SystemExit("failure_drill: --fail stage deletes the stage's Tier-3 objects, so it keeps Tier-3 in its "
                         "work directory; drop the checkpoint.remote.url override")


def plot_run(run_dir: str) -> list[str]:
    """The drill's pictures (megatier-plot's figures) next to its metrics; the files written."""
    try:
        written = list(write_plots(run_dir).written)
    except MetricsMissing as err:
        written, where = [], f"none: {err}"
    else:
        where = f"{', '.join(os.path.basename(p) for p in written)} in {run_dir}"
    print(f"failure_drill: plots {where}", file=sys.stderr, flush=True)
    return written


def _drill_and_report(args, job: Job) -> int:
    ours = node_memory_root(job.work)
    if job.local_root == ours and os.path.isdir(ours):  # left by an earlier drill in a work dir of the same path
        shutil.rmtree(ours)
    recoveries, records, status = run_drill(args, job)
    final = _summary(records)
    # A drill that already went wrong is reported as it is; a reference run would add nothing.
    drilled = not any(rec.problems for rec in recoveries)
    reference = None
    if args.compare and drilled:
        stop_at = recoveries[0].record["end"] if args.no_spare else None
        reference = run_reference(args, args.overrides, stop_at, job.decay_iters)
    problems = final_problems(args, job, recoveries, final, status, reference)
    stall = stall_summary(read_metrics(job, every_launch=True))
    plots = plot_run(job.run_dir)
    print(format_report(args, job, recoveries, final, status, reference, problems, stall))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ok": not problems, "problems": problems, "fail": args.fail, "at_steps": args.at_step,
                       "nodes": args.nodes, "procs_per_node": args.procs_per_node, "no_spare": args.no_spare,
                       "work_dir": job.work,
                       "run_dir": job.run_dir, "recoveries": [r.record for r in recoveries],
                       "notes": [n for r in recoveries for n in r.notes], "final_loss": final.get("loss"),
                       "final_digest": final.get("state_digest"),
                       "final_val_loss": final.get("val_loss"), "stall": stall, "plots": plots,
                       "goodput": goodput_fields(final),
                       "reference_loss": reference.get("loss") if reference else None,
                       "reference_val_loss": reference.get("val_loss") if reference else None,
                       "reference_digest": reference.get("state_digest") if reference else None,
                       "reference_canonical_digest": reference.get("canonical_digest") if reference else None},
                      f, indent=1)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
