"""Running a failure drill: inject each failure, relaunch until the job finishes, judge the recoveries, and
optionally run the same job without a failure to compare (see ``megatier-drill``'s description in
:mod:`megatier.cli.drill`)."""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from typing import Optional

from megatier.drill.job import (
    Job,
    first_error,
    flip_newest_base_byte,
    launch,
    make_job,
    node_memory_root,
    read_metrics,
    recovery_record,
    recovery_timeline,
    stage_ranks,
    summary_record,
    wipe_ranks,
)
from megatier.drill.report import Recovery, check_recovery, final_problems, format_report, goodput_fields, stall_summary
from megatier.drill.spec import DrillError, DrillSpec
from megatier.faults import CrashPoint
from megatier.observe.plot import write_plots
from megatier.observe.run_history import MetricsMissing


@dataclass
class DrillResult:
    """What a drill found: the report's text, its data (``megatier-drill --json``), and whether it passed."""

    report: str
    data: dict

    @property
    def ok(self) -> bool:
        return self.data["ok"]


def inject(spec: DrillSpec, job: Job, at_step: int, k: int) -> int:
    """Launch with the crash point armed at ``at_step`` on the victims; then wipe what the class loses."""
    world = spec.nodes * spec.procs_per_node
    if spec.fail == "stage":
        armed = ",".join(f"{CrashPoint.TRAIN_STEP_END}:{at_step}:{r}" for r in stage_ranks(spec.stage, world, job.pp))
        env = {i: {"MEGATIER_CRASH_AT": armed} for i in range(spec.nodes)}
    else:
        env = {i: {"MEGATIER_CRASH_AT": f"{CrashPoint.TRAIN_STEP_END}:{at_step}"} for i in spec.victims()}
    status = launch(spec.launch, job, f"launch{k}-fail-at-{at_step}", env)
    if spec.fail == "stage":
        gone = wipe_ranks(job, stage_ranks(spec.stage, world, job.pp))
        print(f"failure_drill: stage {spec.stage} lost every copy ({len(gone)} areas and objects deleted)",
              file=sys.stderr, flush=True)
    elif spec.fail in ("node", "rack"):
        for i in spec.victims():
            shutil.rmtree(job.node_area(f"node{i}"), ignore_errors=True)  # the node's memory is gone
    elif spec.corrupt:
        flip_newest_base_byte(job, f"node{spec.victim_node}")
    return status


def run_inprocess(spec: DrillSpec, job: Job) -> tuple[list[Recovery], list[dict], int]:
    """In-process recovery: one launch with every failure armed on its victims (:meth:`DrillSpec.victim_ranks`);
    the survivors and spares recover each in place and the job finishes in the same launch. A node failure
    kills the node's agent, ranks and spares together; its memory is wiped after the launch: nothing reads it
    meanwhile (no process runs on that node any more)."""
    # A node failure kills the node's agent, ranks and spares at once (its process group), as a dead machine.
    how = {"hang": ":stop", "node": ":node"}.get(spec.fail, "")
    armed: dict[int, list[str]] = {}
    for k, step in enumerate(spec.at_steps):
        armed.setdefault(spec.armed_node(k), []).extend(
            f"{CrashPoint.TRAIN_STEP_END}:{step}:{r}{how}" for r in spec.victim_ranks(k))
    env = {node: {"MEGATIER_CRASH_AT": ",".join(points)} for node, points in armed.items()}
    if spec.fail_in_recovery:  # the first replay of rank 0 is the in-place rollback
        env[0] = {"MEGATIER_CRASH_AT": f"{CrashPoint.REPLAY_MID_BATCH}:1:0"}
    status = launch(spec.launch, job, "launch0-inprocess", env)
    if spec.fail == "node":
        shutil.rmtree(job.node_area(f"node{spec.victim_node}"), ignore_errors=True)
    fell_back = status != 0
    if fell_back:  # a round that could not complete ends the launch; the next one restores as after any failure
        status = launch(spec.launch, job, "launch1-relaunch")
    records = read_metrics(job, every_launch=True)
    found = [r for r in records if r.get("event") == "recovery"]
    timings = [{k: v for k, v in r.items() if k.startswith("recovery_")} for r in records if "recovery_total_s" in r]
    recoveries = []
    for k, at_step in enumerate(spec.at_steps):
        rec = Recovery(at_step, status, found[k] if k < len(found) else None,
                       timings[k] if k < len(timings) else None)
        if fell_back and rec.timeline is not None and rec.timeline.get("recovery_mode") == "relaunch":
            rec.notes.append(f"the in-process recovery of the failure at step {at_step} did not complete (a second "
                             f"failure during it); the job fell back to a relaunch, which recovered it")
        check_recovery(spec, job, rec)
        recoveries.append(rec)
    return recoveries, read_metrics(job), status


def run_drill(spec: DrillSpec, job: Job) -> tuple[list[Recovery], list[dict], int]:
    """Inject every failure in turn, then let the job finish; returns the recoveries and the final launch."""
    if spec.inprocess:
        return run_inprocess(spec, job)
    recoveries: list[Recovery] = []
    for k, at_step in enumerate(sorted(spec.at_steps)):
        status = inject(spec, job, at_step, k)
        last = [r["step"] for r in read_metrics(job) if "loss" in r and r.get("event") is None]
        rec = Recovery(at_step, status)
        log_path = os.path.join(job.work, f"launch{k}-fail-at-{at_step}.log")
        if status == 0 or not last or not _died_as_armed(spec, at_step, last[-1], log_path):
            rec.problems.append(f"launch {k} was to die at step {at_step} but exited {status} with its last "
                                f"logged step {last[-1] if last else None}: {first_error(log_path)}; see {log_path}")
        recoveries.append(rec)
        if recoveries[-1].problems:
            return recoveries, read_metrics(job), status
        if k > 0:
            _read_recovery(recoveries[k - 1], read_metrics(job))
    survivors = spec.nodes - len(spec.victims()) if spec.no_spare else spec.nodes
    status = launch(spec.launch.on(survivors), job, f"launch{len(recoveries)}-finish")
    final = read_metrics(job)
    _read_recovery(recoveries[-1], final)
    for rec in recoveries:
        check_recovery(spec, job, rec)
    return recoveries, final, status


def _died_as_armed(spec: DrillSpec, at_step: int, last_logged: int, log_path: str) -> bool:
    """Whether the launch died where the drill armed it: rank 0 logged ``at_step``. A rack failure arms rank 0's
    node-mates too, and one of them may die before rank 0 has logged the step (its agent then stops rank 0):
    rank 0 one step behind counts when the launch's log shows the armed crash at ``at_step``."""
    if last_logged == at_step:
        return True
    if spec.fail != "rack" or last_logged != at_step - 1:
        return False
    try:
        with open(log_path, errors="replace") as f:
            return f"crashing at {CrashPoint.TRAIN_STEP_END} (step {at_step})" in f.read()
    except OSError:
        return False


def _read_recovery(rec: Recovery, records: list[dict]) -> None:
    """The recovery record and timing the launch after a failure logged."""
    rec.record, rec.timeline = recovery_record(records), recovery_timeline(records)


def run_reference(spec: DrillSpec, stop_at: Optional[int] = None, decay_iters: Optional[int] = None) -> dict:
    """The same job without a failure, in its own directories (``stop_at``: trained to that step only, with the
    LR schedule of the full job); returns its summary record."""
    overrides = list(spec.overrides)
    if stop_at is not None:
        keys = ("train.iters=", "optim.decay_iters=")
        overrides = [o for o in overrides if not o.startswith(keys)]
        overrides += [f"train.iters={stop_at}", f"optim.decay_iters={decay_iters}"]
    work = os.path.join(spec.work_dir, "reference")
    ref = make_job(work, overrides, isolated=True, memory_root=node_memory_root(work))
    os.makedirs(ref.work, exist_ok=True)
    status = launch(spec.launch, ref, "reference")
    summary = summary_record(read_metrics(ref))
    if status != 0 or not summary:
        raise DrillError(f"the fault-free reference run failed (exit {status}): "
                         f"{first_error(os.path.join(ref.work, 'reference.log'))}; see {ref.work}/reference.log")
    return summary


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


def prepare(spec: DrillSpec) -> Job:
    """The drilled job in ``<work_dir>/drill``, checked to fit the drill; DrillError (one line) otherwise."""
    problem = spec.problem()
    if problem is not None:
        raise DrillError(problem)
    work = os.path.join(spec.work_dir, "drill")
    extra = [*spec.extra, *(["checkpoint.last_resort=checkfree"] if spec.fail == "stage" else [])]
    job = make_job(work, spec.overrides, memory_root=node_memory_root(work), extra=extra)
    if spec.fail == "stage":
        world = spec.nodes * spec.procs_per_node
        if world % (job.tp * job.pp) or not 0 <= spec.stage < job.pp:
            raise DrillError(f"--stage {spec.stage} is not a pipeline stage of parallel.pp={job.pp} (tp={job.tp}) "
                             f"on {spec.nodes} x {spec.procs_per_node} processes")
        if os.path.abspath(job.remote_root) != os.path.join(work, "remote", job.job_id):
            raise DrillError("--fail stage deletes the stage's Tier-3 objects, so it keeps Tier-3 in its work "
                             "directory; drop the checkpoint.remote.url override")
    if spec.at_steps[-1] >= job.iters:
        raise DrillError(f"--at-step {spec.at_steps[-1]} must be below train.iters={job.iters}, so the job has "
                         f"steps left to finish after recovering")
    if os.path.exists(job.work) and os.listdir(job.work):
        raise DrillError(f"{job.work} is not empty; give a fresh --work-dir (the drill never reuses or deletes an "
                         f"earlier job's checkpoints)")
    os.makedirs(job.work, exist_ok=True)
    return job


def drill(spec: DrillSpec) -> DrillResult:
    """Run the drill ``spec`` describes; node memory is freed at the end (it is RAM), the rest stays in the work
    directory."""
    job = prepare(spec)
    try:
        return _drill_and_judge(spec, job)
    finally:
        for root in {node_memory_root(job.work), node_memory_root(os.path.join(spec.work_dir, "reference"))}:
            if root.startswith("/dev/shm/"):
                shutil.rmtree(root, ignore_errors=True)


def _drill_and_judge(spec: DrillSpec, job: Job) -> DrillResult:
    ours = node_memory_root(job.work)
    if job.local_root == ours and os.path.isdir(ours):  # left by an earlier drill in a work dir of the same path
        shutil.rmtree(ours)
    recoveries, records, status = run_drill(spec, job)
    final = summary_record(records)
    # A drill that already went wrong is reported as it is; a reference run would add nothing.
    drilled = not any(rec.problems for rec in recoveries)
    reference = None
    if spec.compare and drilled:
        stop_at = recoveries[0].record["end"] if spec.no_spare else None
        reference = run_reference(spec, stop_at, job.decay_iters)
    problems = final_problems(spec, job, recoveries, final, status, reference)
    stall = stall_summary(read_metrics(job, every_launch=True))
    plots = plot_run(job.run_dir)
    report = format_report(spec, job, recoveries, final, status, reference, problems, stall)
    data = {"ok": not problems, "problems": problems, "fail": spec.fail, "at_steps": list(spec.at_steps),
            "nodes": spec.nodes, "procs_per_node": spec.procs_per_node, "no_spare": spec.no_spare,
            "work_dir": job.work, "run_dir": job.run_dir, "recoveries": [r.record for r in recoveries],
            "recovery_timelines": [r.timeline for r in recoveries],
            "notes": [n for r in recoveries for n in r.notes], "final_loss": final.get("loss"),
            "final_digest": final.get("state_digest"), "final_val_loss": final.get("val_loss"), "stall": stall,
            "plots": plots, "goodput": goodput_fields(final),
            "reference_loss": reference.get("loss") if reference else None,
            "reference_val_loss": reference.get("val_loss") if reference else None,
            "reference_digest": reference.get("state_digest") if reference else None,
            "reference_canonical_digest": reference.get("canonical_digest") if reference else None}
    return DrillResult(report, data)
