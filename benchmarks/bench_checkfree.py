#!/usr/bin/env python
"""CheckFree's convergence after a stage loss (Figure 2 of CheckFree, arXiv:2506.15461): weighted average, copy, random.

One job (a small GPT on ``--pp`` pipeline stages, one process per stage on one
simulated node, Tier-1 only) trains with checkpointing and is killed after step
``--fail-at``. Its node memory is copied once per variant and each copy is
relaunched to ``train.iters``:

  fault-free  nothing lost: the relaunch resumes exactly (the reference curve)
  weighted    stage ``--stage`` loses every copy; CheckFree rebuilds it as the average
              of its neighbours weighted by their last squared gradient norms
  copy        the same loss; the stage becomes a copy of the previous stage
  random      the same loss; the stage gets a fresh GPT-2 initialisation

(``checkpoint.last_resort=checkfree`` with ``checkpoint.checkfree.init`` =
weighted / copy / random.) Every variant sees the same data in the same order
from the same state of the other stages, so the curves differ by the rebuild only.

With ``--plus`` the same job also trains with ``model.pipeline_order=checkfree_plus``
(every second micro-batch through the swapped route) and is killed at the same
step; its copies relaunch as ``plus fault-free`` and ``plus stage 0`` (the first
stage lost: rebuilt from its stand-in, stage 1, and exact copies of its
embedding). What the swapped order costs without failures is the difference of
the two orders before the failure: validation loss at ``--fail-at`` and the
median step time of each failed launch. Step times of launches that ran at
different moments are not comparable on a shared box: ``--timing R`` instead
runs R short fault-free launches of each order alternately (``--timing-steps``
steps each, checkpointing as configured) and prints each order's median step time over
every launch with the spread of the launches' medians.
The table gives the validation loss (``eval_iters`` held-out batches every
``eval_interval`` steps) at fixed steps after the recovery, and each variant's gap
to the fault-free run there; ``--json`` writes the curves.

    python benchmarks/bench_checkfree.py --fail-at 300 --iters 600 --work-dir /tmp/cf -- \\
        model=tiny model.num_layers=8 model.hidden_size=128
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from typing import Optional

from megatier.config import split_overrides
from megatier.drill.job import Job, launch, make_job, read_metrics, wipe_ranks
from megatier.drill.spec import LaunchSettings
from megatier.faults import CrashPoint

VARIANTS = ("fault-free", "weighted", "copy", "random")
DEFAULTS = ["model=tiny", "model.num_layers=4", "data.seq_len=64", "train.global_batch_size=8",
            "train.micro_batch_size=2", "optim.lr=3e-3", "optim.warmup_iters=20", "train.eval_interval=10",
            "train.eval_iters=4", "checkpoint.tiers=[local]", "checkpoint.base_interval=50",
            "checkpoint.diff.compression=fp32", "logging.wandb.mode=disabled", "parallel.timeout_s=60"]


def _cluster_args(args) -> LaunchSettings:
    return LaunchSettings(nodes=1, procs_per_node=args.pp, fail_grace_s=2.0, timeout_s=args.timeout_s)


def _job(work: str, args, extra: list[str]) -> Job:
    overrides = [*DEFAULTS, f"parallel.pp={args.pp}", f"train.iters={args.iters}", *args.overrides, *extra]
    return make_job(work, overrides)


def _fail(args, order: str) -> Job:
    """The job trained to ``--fail-at`` and killed there (every process: nothing of it survives but node memory)."""
    job = _job(os.path.join(args.work_dir, f"failed-{order}"), args, [f"model.pipeline_order={order}"])
    os.makedirs(job.work)
    env = {0: {"MEGATIER_CRASH_AT": f"{CrashPoint.TRAIN_STEP_END}:{args.fail_at}"}}
    status = launch(_cluster_args(args), job, "fail", env)
    if status == 0:
        raise SystemExit(f"bench_checkfree: the job was to die after step {args.fail_at} but finished")
    return job


def _variant(args, failed: Job, name: str, order: str = "standard", init: Optional[str] = None,
             lost: Optional[int] = None) -> dict:
    """Relaunch a copy of the failed job's node memory as ``name``, with stage ``lost`` wiped (None: nothing
    lost) and rebuilt with ``init``; its validation curve and recovery record."""
    extra = [f"model.pipeline_order={order}"]
    if lost is not None:
        extra += ["checkpoint.last_resort=checkfree", f"checkpoint.checkfree.init={init}"]
    job = _job(os.path.join(args.work_dir, name.replace(" ", "-")), args, extra)
    os.makedirs(job.work)
    shutil.copytree(failed.local_root, job.local_root)
    if lost is not None:
        wipe_ranks(job, [lost])  # one process per stage
    status = launch(_cluster_args(args), job, "relaunch")
    records = read_metrics(job)
    if status != 0:
        raise SystemExit(f"bench_checkfree: variant {name} failed (exit {status}); see {job.work}/relaunch.log")
    recovery = next((r for r in records if r.get("event") == "recovery"), None)
    val = {r["step"]: r["val_loss"] for r in records if r.get("val_loss") is not None and r.get("event") is None}
    train = {r["step"]: r["loss"] for r in records if "loss" in r and r.get("event") is None}
    return {"recovery": recovery, "val_loss": val, "loss": train}


def before_failure(failed: Job) -> dict:
    """The failed launch's last validation loss and median step time: the order's cost without a failure."""
    records = [r for r in read_metrics(failed) if r.get("event") is None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    times = sorted(r["iter_time_s"] for r in records if "iter_time_s" in r)
    return {"val_step": val[-1][0], "val_loss": val[-1][1], "step_ms": 1000 * times[len(times) // 2]}


def timing(args) -> dict[str, list[float]]:
    """Median step time (ms) of each of ``--timing`` alternating fault-free launches per order."""
    out: dict[str, list[float]] = {"standard": [], "checkfree_plus": []}
    for r in range(args.timing):
        for order in out:
            job = _job(os.path.join(args.work_dir, f"timing-{order}-{r}"), args,
                       [f"model.pipeline_order={order}", f"train.iters={args.timing_steps}",
                        f"train.eval_interval={args.timing_steps}"])
            os.makedirs(job.work)
            if launch(_cluster_args(args), job, "timing") != 0:
                raise SystemExit(f"bench_checkfree: timing launch failed; see {job.work}/timing.log")
            steps = [rec["iter_time_s"] for rec in read_metrics(job) if "iter_time_s" in rec]
            times = sorted(steps[1:])  # the first step warms up
            out[order].append(1000 * times[len(times) // 2])
    return out


def table(results: dict[str, dict], steps: list[int]) -> str:
    """Validation loss per variant at ``steps``, and the gap to the fault-free run (absolute, %)."""
    ref = results["fault-free"]["val_loss"]
    head = "variant     " + "".join(f"  step {s:>5}" for s in steps) + "   mean gap"
    lines = [head, "-" * len(head)]
    for name, res in results.items():
        vals = [res["val_loss"].get(s) for s in steps]
        gaps = [v - ref[s] for v, s in zip(vals, steps) if v is not None and s in ref]
        lines.append(f"{name:<12}" + "".join(f"  {v:10.4f}" if v is not None else "         n/a" for v in vals)
                     + (f"   {sum(gaps) / len(gaps):+.4f}" if gaps else ""))
    return "\n".join(lines)


def report_steps(fail_at: int, iters: int, every: int) -> list[int]:
    """The first evaluation after the recovery, then a few spread up to the end."""
    first = (fail_at // every + 1) * every
    picks = {first, first + every, fail_at + (iters - fail_at) // 4, fail_at + (iters - fail_at) // 2, iters}
    return sorted(s for s in picks if s <= iters and (s % every == 0 or s == iters))


def run(args) -> tuple[dict, dict]:
    """Every variant's curves, and each order's figures before the failure."""
    failed = _fail(args, "standard")
    results = {name: _variant(args, failed, name, init=name, lost=None if name == "fault-free" else args.stage)
               for name in args.variants}
    orders = {"standard": before_failure(failed)}
    if args.plus:
        plus = _fail(args, "checkfree_plus")
        orders["checkfree_plus"] = before_failure(plus)
        results["plus fault-free"] = _variant(args, plus, "plus fault-free", "checkfree_plus")
        results["plus stage 0"] = _variant(args, plus, "plus stage 0", "checkfree_plus", "weighted", lost=0)
    return results, orders


def parse_args(argv: list[str]) -> argparse.Namespace:
    argv, overrides = split_overrides(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Hydra overrides go after --")
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--stage", type=int, default=2, help="the stage that loses every copy (an intermediate one)")
    p.add_argument("--fail-at", type=int, default=300)
    p.add_argument("--iters", type=int, default=600)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--plus", action="store_true", help="also a checkfree_plus job losing its first stage")
    p.add_argument("--timing", type=int, default=0, help="only time R alternating launches of each order")
    p.add_argument("--timing-steps", type=int, default=60)
    p.add_argument("--work-dir", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--timeout-s", type=float, default=1800.0)
    args = p.parse_args(argv)
    args.overrides = overrides
    args.variants = args.variants.split(",")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown or "fault-free" not in args.variants:
        p.error(f"--variants: choose from {', '.join(VARIANTS)}, fault-free included (the reference)")
    if not 0 < args.stage < args.pp - 1:
        p.error(f"--stage {args.stage}: CheckFree rebuilds an intermediate stage, 1..{args.pp - 2}")
    if not 0 < args.fail_at < args.iters:
        p.error("--fail-at must be in (0, --iters)")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    args.work_dir = os.path.abspath(args.work_dir or tempfile.mkdtemp(prefix="megatier_checkfree_"))
    if os.path.exists(args.work_dir) and os.listdir(args.work_dir):
        raise SystemExit(f"bench_checkfree: {args.work_dir} is not empty; give a fresh --work-dir")
    if args.timing:
        times = timing(args)
        for order, ms in times.items():
            print(f"{order}: median step {sorted(ms)[len(ms) // 2]:.1f} ms over {args.timing} launches "
                  f"(launch medians {', '.join(f'{m:.1f}' for m in ms)})")
        return 0
    results, orders = run(args)
    every = next(int(o.split("=")[1]) for o in [*DEFAULTS, *args.overrides][::-1]
                 if o.startswith("train.eval_interval="))
    steps = report_steps(args.fail_at, args.iters, every)
    print(f"CheckFree convergence: stage {args.stage} of {args.pp} lost after step {args.fail_at}"
          f"{' (plus: stage 0)' if args.plus else ''}, validation loss after recovery; gap to the standard "
          f"fault-free run (work dir {args.work_dir})")
    print(table(results, steps))
    for order, o in orders.items():
        print(f"  before the failure, {order}: val_loss {o['val_loss']:.4f} at step {o['val_step']}, "
              f"median step {o['step_ms']:.1f} ms")
    for name, res in results.items():
        cf = (res["recovery"] or {}).get("checkfree")
        if cf:
            print(f"  {name}: {cf['rebuilds']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "steps": steps, "results": results, "orders": orders}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
