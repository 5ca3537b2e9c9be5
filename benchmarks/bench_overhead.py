#!/usr/bin/env python
"""Per-step checkpointing overhead of MegaTier against the usual baselines, in one run.

Every row trains the same model from the same seed on the same data for the
same steps, each run as its own torchrun job of --nproc processes (1 by
default). A fresh process per run, as a real job has: a Trainer built after
another one closed in the same process trained ~25% slower per step on the
2-core box (it follows the closing Trainer's gather of the whole state for its
digest), its idle OpenMP thread no longer spinning between the loop's parallel
ops, so in-process runs measured neither the training nor the checkpoint
hook's CPU as a job pays them.

  none                   no checkpointing: the reference
  megatier               tiered checkpointing (checkpoint=tiered, tiers local+remote on
                         one node: Tier-1 under /dev/shm, Tier-3 a directory), a
                         differential checkpoint every step, a base every --base-interval
  sync_torch_save        Megatron's default: blocking torch.save of the full state
                         every K steps to the remote directory
  dcp_async_save         torch.distributed.checkpoint.async_save every K steps
  in_memory_every_step   Gemini-style full copy into host memory every step
  snapshot_then_persist  CheckFreq-style snapshot every K steps, persisted by a thread

(benchmarks/baselines.py defines the baselines.)

A step's time is what the loop spends on it: the trainer's ``iter_time_s``
(forward, backward, optimizer step; background checkpoint threads compete for
the same cores here, so their cost lands in it) plus ``ckpt_stall_ms`` (the
after_step hook: the checkpoint work done in the loop). Evaluation is off. The
first --warmup steps are excluded; a run's figure is the mean of the rest. The
remote directory is the same local disk for every row, with no fsync anywhere:
Megatron's torch.save does not fsync, so MegaTier runs with
checkpoint.remote.fsync=false for the same durability (add
``-- checkpoint.remote.fsync=true`` to measure what fsync costs on this disk).

Timings on a small shared CPU box are noisy and drift, so every other run is
``none``: none, A, none, B, ..., none, repeated --repeats times with the order of
the other rows reversed every other repetition. A run's overhead is its mean step
time over the mean of the two ``none`` runs around it; the table reports, per
row, the median over repetitions (and the min..max), next to the median step
time. Interference from other tenants only ever slows a run, so the table also
gives each row's fastest run over the fastest of its references ("of fastest";
a reference is the mean of the ``none`` runs around a run, so both minima are
taken over as many samples). The default window (--iters
160, --warmup 110) spans exactly 50 steps: one base_interval=50 and two periods
of K=25, so each row pays a whole number of its checkpoints in the window. It is
the third base interval, a long job's steady state: by then MegaTier writes
each base and each capture part over the node-memory files of reclaimed ones,
as it does for the rest of a run; in the first interval they go into fresh
tmpfs pages (its save thread and copier used 3.1 ms of CPU per step there
against 2.1 ms in the third, demo model on the 2-core box). ``--iters 60
--warmup 10`` measures the first interval.

CPU time: wall time on a shared box also counts the time a run waited for a
core; CPU seconds count only what it used (contention still inflates them, via
shared caches and cores, but far less), so a second table gives every row by
CPU: rank 0's process, user+sys at nanosecond resolution, per step over the same
steps as above (from the start of step --warmup+1 to the end of the loop, so it
also holds the per-step metrics logging, alike in every row). It splits into

  helpers   every Python thread started while the run is built and trained
            (the save worker, Tier-2 replicator, Tier-3 uploader, coordinator
            and lease; a baseline's persist thread, DCP's executor), each read
            from its own thread CPU clock; a thread that ends reports its total
            as its run() returns, so short-lived ones are counted in full
  in hook   what the other threads (the main thread, its OpenMP team, gloo's;
            listed at the window's start) used inside after_step, each read
            from its own thread CPU clock: e.g. MegaTier's diff compression.
            (Not the process clock, which brings only the calling thread up to
            date: a team thread spinning on the other core before the hook had
            that spin accounted when the hook parked it, ~1 ms per step of
            training CPU counted as the hook's on the 2-core box)
  training  the rest: forward, backward, optimizer step, gloo, logging

"ckpt %" = (helpers + in hook) / training of the same run: a ratio within one
run, so a slowdown of the whole box largely cancels. Native threads a helper
spawns (an OpenMP team of its own) count as training there; "vs none", the
process CPU per step over the mean of the ``none`` runs around the run (paired
like the wall overhead), includes everything. Each figure is the median over
repeats with min..max. The probes add two reads of each non-helper thread's
clock to every after_step call (~20 threads, tens of microseconds, inside
``ckpt_stall_ms`` and the in-hook CPU). Targets: MegaTier's ckpt % at most 2% with a diff every
step; its wall overhead, with its min..max, the lowest among the rows
checkpointing every step.

Checkpoint intervals (--k, a list): MegaTier saves a recovery point every step,
so K=1 compares at the same recovery granularity, as TierCheck's Exp#1 does
(per-iteration snapshots for every system; TierCheck, arXiv:2605.17821). K=25 is what the
baselines can afford: TierCheck (Exp#3) finds the intervals at which they stay
within a 3.5% slowdown to be about 11 (Gemini, DataStates-LLM) and 21-22
(CheckFreq), and Megatron users configure --save-interval in that range. Rows
at K appear as ``<row>@K``.

    python benchmarks/bench_overhead.py                                  # 49 runs, ~45 min on 2 cores
    python benchmarks/bench_overhead.py --repeats 8 --rows none,megatier   # MegaTier alone, more pairs
    python benchmarks/bench_overhead.py --k 25 --rows none,megatier,sync_torch_save
    python benchmarks/bench_overhead.py --out-json bench.json -- train.global_batch_size=16
    python benchmarks/bench_overhead.py --nproc 2                        # world of two via torchrun
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.cpu_time import CpuMeter, HelperThreads  # noqa: E402
from megatier.config import split_overrides  # noqa: E402

ROWS = ("none", "megatier", "sync_torch_save", "dcp_async_save", "in_memory_every_step", "snapshot_then_persist")
EVERY_K = ("sync_torch_save", "dcp_async_save", "snapshot_then_persist")  # rows with a checkpoint interval K
TARGET_PCT = 3.5
CPU_TARGET_PCT = 2.0  # checkpoint CPU (helpers + in hook) as % of training CPU
RUN_ENV = "MEGATIER_BENCH_RUN"  # set by run_under_torchrun for its children
MIB = 1 << 20


def parse_args(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    original = list(argv)
    argv, overrides = split_overrides(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Hydra overrides for every row go after `--`.")
    p.add_argument("--model", default="small", help="model preset (configs/model/)")
    p.add_argument("--iters", type=int, default=160, help="training steps per run")
    p.add_argument("--warmup", type=int, default=110, help="first steps excluded from the mean (two base "
                                                              "intervals and the first steps of the third)")
    p.add_argument("--k", default="1,25", help="checkpoint interval(s) K of sync_torch_save, dcp_async_save, "
                                               "snapshot_then_persist: a comma-separated list, one row per K")
    p.add_argument("--base-interval", type=int, default=50, help="MegaTier's base interval (diffs every step)")
    p.add_argument("--repeats", type=int, default=3, help="runs per row, in alternating order")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    p.add_argument("--out-json", default=None, help="write every run's figures and the summary here")
    p.add_argument("--nproc", type=int, default=1, help="processes (world size) on this host, of each run's torchrun "
                                                         "job")
    p.add_argument("--work-dir", default=None, help="where runs and the remote directory go (default: a temp dir)")
    p.add_argument("--shm-dir", default="/dev/shm", help="parent of MegaTier's Tier-1 root")
    p.add_argument("--keep", action="store_true", help="keep checkpoints and run directories")
    args = p.parse_args(argv)
    args.argv = original
    args.overrides = overrides
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        p.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    if not 0 <= args.warmup < args.iters:
        p.error(f"--warmup={args.warmup} must be in [0, --iters={args.iters})")
    try:
        args.ks = sorted({int(k) for k in str(args.k).split(",") if k.strip()})
    except ValueError:
        p.error(f"--k={args.k!r} must be a comma-separated list of integers")
    if not args.ks or min(args.ks) < 1 or args.repeats < 1 or args.nproc < 1:
        p.error("--k, --repeats and --nproc must be >= 1")
    args.specs = expand_rows(args.rows, args.ks)
    return args


def expand_rows(rows: list[str], ks: list[int]) -> list[str]:
    """Run specs: each row with an interval once per K (``sync_torch_save@25``), the others as named."""
    return [spec for row in rows for spec in ([f"{row}@{k}" for k in ks] if row in EVERY_K else [row])]


def split_spec(spec: str) -> tuple[str, int | None]:
    """``sync_torch_save@25`` -> ("sync_torch_save", 25); ``megatier`` -> ("megatier", None)."""
    row, _, k = spec.partition("@")
    return row, (int(k) if k else None)


def run_under_torchrun(args, row: str, tag: str, dirs: dict, changes: dict) -> dict:
    """One run as its own torchrun job of --nproc processes; returns rank 0's figures.

    Fresh processes for every run (see the module docstring; besides, a second Trainer after ``close()``
    hung inside torchrun workers). Arguments travel in the environment: torchrun's own parser would take
    --nproc for its --nproc-per-node.
    """
    out = os.path.join(dirs["work"], f"result-{row}-{tag}.json")
    spec = {"argv": args.argv, "changes": changes, "row": row, "tag": tag, "dirs": dirs, "out": out}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           os.path.abspath(__file__)]
    rc = subprocess.call(cmd, env={**os.environ, RUN_ENV: json.dumps(spec)})
    if rc != 0:
        raise SystemExit(f"run {row}-{tag} failed under torchrun (exit {rc})")
    with open(out) as f:
        return json.load(f)


def torchrun_child(spec: dict) -> int:
    """Inside a torchrun job started by run_under_torchrun: one run, rank 0 writes its figures."""
    args = parse_args(spec["argv"])
    for key, value in spec["changes"].items():
        setattr(args, key, value)
    args.nproc = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    res = run_one(spec["row"], spec["tag"], args, spec["dirs"], rank)
    if rank == 0:
        with open(spec["out"], "w") as f:
            json.dump(res, f)
    return 0


# ---- one run ------------------------------------------------------------------------------------

def make_baseline(row: str, state, directory: str, k: int):
    """The baseline checkpointer of ``row`` for a TrainState (the Trainer's checkpointer factory calls this)."""
    from benchmarks import baselines as b

    ps, o, m = state.ps, state.optimizer, state.model
    if row == "sync_torch_save":
        return b.SyncTorchSave(o, m, directory, k, rank=ps.rank, group=ps.checkpoint_group)
    if row == "dcp_async_save":
        return b.DcpAsyncSave(o, m, directory, k, rank=ps.rank, process_group=ps.checkpoint_group,
                              coords=(ps.pp_rank, ps.tp_rank, ps.dp_rank))
    if row == "in_memory_every_step":
        return b.InMemoryEveryStep(o, m)
    if row == "snapshot_then_persist":
        return b.SnapshotThenPersist(o, m, directory, k, rank=ps.rank)
    raise ValueError(row)


def read_steps(metrics_path: str) -> list[dict]:
    with open(metrics_path) as f:
        return [r for r in map(json.loads, f) if "iter_time_s" in r]


def train_and_close(trainer, meter: CpuMeter, steps: int) -> tuple[float, dict, float]:
    """Train, then close (which drains the checkpointer: not part of any step); returns
    (train seconds, the window's CPU split, close seconds)."""
    try:
        t0 = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - t0
        cpu = meter.finish(steps)
        t0 = time.perf_counter()
        trainer.close()
        return train_s, cpu, time.perf_counter() - t0
    except BaseException:
        # Stop the failed checkpointer's threads (best effort, bounded) so they do not load the
        # next rows, and leave the process able to build the next Trainer (a new default group).
        import torch.distributed as dist

        if trainer.checkpointer is not None:
            closer = threading.Thread(target=lambda: trainer.checkpointer.close(), daemon=True)
            closer.start()
            closer.join(30.0)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise


def run_one(spec: str, tag: str, args, dirs: dict, rank: int) -> dict:
    """Train one row (a run spec, see split_spec) from scratch; returns its figures (rank 0's records)."""
    from megatier.config import compose_config
    from megatier.training.trainer import Trainer

    row, k = split_spec(spec)
    name = f"{row}{'' if k is None else f'-k{k}'}-{tag}"
    run_dir = os.path.join(dirs["work"], "runs", name)
    remote = os.path.join(dirs["work"], "remote", name)
    local_root = os.path.join(dirs["shm"], name)
    overrides = [f"model={args.model}", f"train.iters={args.iters}", "train.eval_iters=0",
                 f"train.eval_interval={args.iters + 1}", "logging.wandb.mode=disabled", "logging.progress=false",
                 f"logging.name={name}", f"logging.run_dir={run_dir}"]
    if row == "megatier":
        overrides += ["checkpoint=tiered", "checkpoint.tiers=[local,remote]",
                      f"checkpoint.base_interval={args.base_interval}", f"checkpoint.local.root={local_root}",
                      f"checkpoint.remote.url={remote}", "checkpoint.remote.fsync=false",
                      f"checkpoint.job_id=bench-{name}"]
    factory = None
    if row not in ("none", "megatier"):
        def factory(state):
            return make_baseline(row, state, remote, k or 1)
    with HelperThreads() as helpers:  # from before the checkpointer's construction to after its close
        trainer = Trainer(compose_config(overrides + args.overrides), checkpointer=factory)
        meter = CpuMeter(helpers, args.warmup)
        meter.instrument(trainer)
        train_s, cpu, close_s = train_and_close(trainer, meter, args.iters - args.warmup)
    baseline = trainer.checkpointer if factory is not None else None
    manager = trainer.checkpointer if row == "megatier" else None
    out = {"row": spec, "k": k, "tag": tag, "train_s": train_s, "close_s": close_s, **cpu}
    if rank != 0:
        return out
    records = read_steps(os.path.join(run_dir, "metrics.jsonl"))
    window = [r for r in records if r["step"] > args.warmup]
    step_s = [r["iter_time_s"] + r.get("ckpt_stall_ms", 0.0) / 1000.0 for r in window]
    stalls = sorted(r.get("ckpt_stall_ms", 0.0) for r in window)
    out.update(steps=len(window), mean_step_s=statistics.fmean(step_s), median_step_s=statistics.median(step_s),
               mean_compute_s=statistics.fmean(r["iter_time_s"] for r in window),
               mean_stall_ms=statistics.fmean(stalls), median_stall_ms=statistics.median(stalls),
               p99_stall_ms=stalls[min(len(stalls) - 1, int(0.99 * len(stalls)))], max_stall_ms=stalls[-1],
               shard_state_bytes=3 * 4 * trainer.optimizer.master.numel())
    if trainer.device.type == "cuda":  # what the row's checkpointing adds to the GPU's memory, over the run
        import torch

        out["peak_gpu_mib"] = torch.cuda.max_memory_allocated(trainer.device) / 2**20
    if baseline is not None:
        out.update(baseline.summary())
    if manager is not None:
        diff_total, base_total = manager.worker.diff_bytes, manager.worker.base_bytes
        bases = 1 + args.iters // args.base_interval  # the anchor at step 0, then every base_interval
        d = trainer.cfg.checkpoint.diff
        out.update(checkpoints=args.iters, diff_bytes_per_step=diff_total / args.iters,
                   diff=f"{d.compression} (top-k {d.topk_ratio}, int8 below {d.small_threshold} elements), "
                        f"batch {d.batch}", tiers=list(trainer.cfg.checkpoint.tiers),
                   base_bytes_per_base=base_total / bases, bases=bases,
                   bytes_per_checkpoint=diff_total / args.iters,
                   mean_ckpt_budget_ms=statistics.fmean(r.get("ckpt_budget_ms", 0.0) for r in window))
    if not args.keep:
        for path in (remote, local_root, run_dir):
            shutil.rmtree(path, ignore_errors=True)
    return out


# ---- the report ---------------------------------------------------------------------------------

def schedule(rows: list[str], repeats: int) -> list[tuple[str, int]]:
    """(row, repetition) in run order.

    With ``none`` among the rows, every other run is ``none`` (none, A, none, B, ...,
    none), so each checkpointing run is compared with the reference runs right
    before and after it and slow drifts of the machine cancel; the order of the
    other rows is reversed every other repetition. Without ``none``, the rows
    alternate forward and reversed.
    """
    others = [r for r in rows if r != "none"]
    seq: list[tuple[str, int]] = [("none", 0)] if "none" in rows else []
    for rep in range(repeats):
        for row in (others if rep % 2 == 0 else list(reversed(others))):
            seq.append((row, rep))
            if "none" in rows:
                seq.append(("none", rep))
    if "none" in rows and not others:
        seq += [("none", rep) for rep in range(1, repeats)]
    return seq


def paired_overheads(runs: list[dict]) -> None:
    """Set ``overhead_pct`` (step time) and ``cpu_overhead_pct`` (process CPU per step) of each checkpointing
    run against the mean of its neighbouring none runs."""
    ok = [x for x in runs if "error" not in x]
    for i, x in enumerate(ok):
        if x["row"] == "none":
            continue
        before = next((y for y in reversed(ok[:i]) if y["row"] == "none"), None)
        after = next((y for y in ok[i + 1:] if y["row"] == "none"), None)
        refs = [y for y in (before, after) if y is not None]
        if refs:
            x["none_ref_s"] = statistics.fmean(y["mean_step_s"] for y in refs)
            x["overhead_pct"] = 100.0 * (x["mean_step_s"] / x["none_ref_s"] - 1.0)
        if refs and all("cpu_ms" in y for y in [x, *refs]):
            x["none_ref_cpu_ms"] = statistics.fmean(y["cpu_ms"] for y in refs)
            x["cpu_overhead_pct"] = 100.0 * (x["cpu_ms"] / x["none_ref_cpu_ms"] - 1.0)


def cpu_summary(row: str, xs: list[dict]) -> dict:
    """A row's CPU figures over its runs: median with min and max (``<key>_min``, ``<key>_max``) of the
    process CPU per step, its paired overhead and the checkpoint CPU share; medians of the split."""
    s = {}
    for key in ("cpu_ms", "cpu_overhead_pct", "ckpt_cpu_pct"):
        if all(key in x for x in xs):
            vals = [x[key] for x in xs]
            s.update({key: statistics.median(vals), f"{key}_min": min(vals), f"{key}_max": max(vals)})
    if row == "none" and "cpu_ms" in s:
        s.update(cpu_overhead_pct=0.0, cpu_overhead_pct_min=0.0, cpu_overhead_pct_max=0.0)
    for key in ("helper_cpu_ms", "hook_cpu_ms", "train_cpu_ms"):
        if all(key in x for x in xs):
            s[key] = statistics.median(x[key] for x in xs)
    return s


def summarize(runs: list[dict], rows: list[str]) -> dict:
    paired_overheads(runs)
    by_row = {r: [x for x in runs if x["row"] == r and "error" not in x] for r in rows}
    summary = {}
    for row, xs in by_row.items():
        if not xs:
            errors = sorted({x["error"] for x in runs if x["row"] == row})
            summary[row] = {"runs": 0, "failed": len([x for x in runs if x["row"] == row]), "errors": errors}
            continue
        means = [x["mean_step_s"] for x in xs]
        s = {"runs": len(xs), "mean_step_s": statistics.median(means), "min_step_s": min(means),
             "max_step_s": max(means), "mean_stall_ms": statistics.median(x["mean_stall_ms"] for x in xs),
             "max_stall_ms": max(x["max_stall_ms"] for x in xs),
             "checkpoints": xs[0].get("checkpoints", 0), "bytes_per_checkpoint": xs[0].get("bytes_per_checkpoint"),
             "disk_bytes_per_checkpoint": xs[0].get("disk_bytes_per_checkpoint"),
             "shard_state_bytes": xs[0]["shard_state_bytes"]}
        if row == "none":
            s.update(overhead_pct=0.0, overhead_min_pct=0.0, overhead_max_pct=0.0)
        elif all("overhead_pct" in x for x in xs):
            ovh = [x["overhead_pct"] for x in xs]
            s.update(overhead_pct=statistics.median(ovh), overhead_min_pct=min(ovh), overhead_max_pct=max(ovh))
        s["failed"] = len([x for x in runs if x["row"] == row and "error" in x])
        refs = [x["none_ref_s"] for x in xs if "none_ref_s" in x]
        if refs:
            # Interference only slows runs: the fastest run over the fastest of its references (each the
            # mean of the none runs around a run of the row, so both minima are over equally many samples)
            # estimates the cost on a quiet machine.
            s["fastest_pct"] = 100.0 * (min(means) / min(refs) - 1.0)
        s.update(cpu_summary(row, xs))
        if row == "megatier":
            diff = statistics.median(x["diff_bytes_per_step"] for x in xs)
            s.update(diff=xs[0]["diff"], tiers=xs[0]["tiers"], diff_bytes_per_step=diff,
                     base_bytes_per_base=statistics.median(x["base_bytes_per_base"] for x in xs),
                     diff_fraction_of_shard_state=diff / xs[0]["shard_state_bytes"])
        summary[row] = s
    return summary


def _mib(n) -> str:
    return "-" if n is None else f"{n / MIB:.2f}"


def _every(spec: str) -> str:
    row, k = split_spec(spec)
    return {"none": "-", "megatier": "1 (diff)", "in_memory_every_step": "1"}.get(row, str(k))


def _span(s: dict, key: str, fmt: str) -> str:
    return f"{s[key + '_min']:{fmt}}..{s[key + '_max']:{fmt}}" if key + "_min" in s else "-"


def _table_head(legend: list[str], header: str) -> None:
    """A blank line, the legend's lines, the column header and its rule."""
    print()
    for line in legend:
        print(line)
    print(header)
    print("-" * len(header))


def print_cpu_table(summary: dict, args) -> None:
    """The same rows by CPU seconds (rank 0's process, user+sys), which other tenants of the box hardly move."""
    rows = {spec: s for spec, s in summary.items() if s["runs"] and "cpu_ms" in s}
    if not rows:
        return
    _table_head([f"CPU per step = user+sys CPU of the process (every thread) from the start of step "
                 f"{args.warmup + 1} to the end of the loop / {args.iters - args.warmup} steps; CPU ms = median over "
                 f"repeats (min..max);",
                 "vs none = median over repeats of (run / mean of the `none` runs just before and after it) - 1 "
                 "(min..max);",
                 "helpers = Python threads the checkpointer started; in hook = the other threads' CPU inside "
                 "after_step (thread clocks);",
                 "training = the rest; ckpt % = (helpers + in hook) / training (median over repeats, min..max)"],
                f"{'row':<24} {'CPU ms':>8} {'min..max ms':>15} {'vs none':>8} {'min..max %':>15} "
                f"{'helpers ms':>10} {'in hook ms':>10} {'training ms':>11} {'ckpt %':>7} {'min..max %':>13}")
    for spec, s in rows.items():
        vs = f"{s['cpu_overhead_pct']:+.1f}%" if "cpu_overhead_pct" in s else "-"
        ckpt = f"{s['ckpt_cpu_pct']:.2f}%" if "ckpt_cpu_pct" in s else "-"
        print(f"{spec:<24} {s['cpu_ms']:>8.1f} {_span(s, 'cpu_ms', '.1f'):>15} {vs:>8} "
              f"{_span(s, 'cpu_overhead_pct', '+.1f') if spec != 'none' else '-':>15} "
              f"{s.get('helper_cpu_ms', 0.0):>10.2f} "
              f"{s.get('hook_cpu_ms', 0.0):>10.2f} {s.get('train_cpu_ms', 0.0):>11.1f} {ckpt:>7} "
              f"{_span(s, 'ckpt_cpu_pct', '.2f'):>13}")


def print_report(summary: dict, args, full_state_bytes: int | None) -> None:
    _table_head([f"model={args.model} iters={args.iters} warmup={args.warmup} (mean over steps "
                 f"{args.warmup + 1}..{args.iters}) K={','.join(map(str, args.ks))} "
                 f"base_interval={args.base_interval} repeats={args.repeats} world={args.nproc}"
                 + (f" overrides={args.overrides}" if args.overrides else ""),
                 "step time = iter_time_s + ckpt_stall_ms, mean over the window; step ms = median over repeats "
                 "(min..max);",
                 "overhead = median over repeats of (run / mean of the `none` runs just before and after it) - 1 "
                 "(min..max);",
                 "of fastest = the row's fastest run / the fastest of its references (the none means above) - 1"],
                f"{'row':<24} {'ckpt every':>10} {'step ms':>8} {'min..max ms':>15} {'overhead':>9} "
                f"{'min..max %':>15} {'of fastest':>10} {'stall ms':>9} {'max stall':>9} {'MiB/ckpt':>9} "
                f"{'MiB disk':>9}")
    for spec, s in summary.items():
        if not s["runs"]:
            print(f"{spec:<24} {_every(spec):>10} FAILED in all {s['failed']} runs: {'; '.join(s['errors'])[:300]}")
            continue
        over = f"{s['overhead_pct']:+.1f}%" if "overhead_pct" in s else "-"
        span = (f"{s['overhead_min_pct']:+.1f}..{s['overhead_max_pct']:+.1f}"
                if "overhead_min_pct" in s and spec != "none" else "-")
        fastest = f"{s['fastest_pct']:+.1f}%" if "fastest_pct" in s and spec != "none" else "-"
        print(f"{spec:<24} {_every(spec):>10} {1000 * s['mean_step_s']:>8.1f} "
              f"{1000 * s['min_step_s']:>7.1f}..{1000 * s['max_step_s']:<7.1f} {over:>9} {span:>15} {fastest:>10} "
              f"{s['mean_stall_ms']:>9.2f} {s['max_stall_ms']:>9.1f} {_mib(s['bytes_per_checkpoint']):>9} "
              f"{_mib(s['disk_bytes_per_checkpoint']):>9}")
    print_cpu_table(summary, args)
    failed = {r: s["failed"] for r, s in summary.items() if s.get("failed")}
    if failed:
        print("failed runs (left out above): " + ", ".join(f"{r} x{n}" for r, n in failed.items()))
    m = summary.get("megatier")
    if m is not None and m["runs"]:
        shard = m["shard_state_bytes"]
        print()
        print(f"megatier: diff {m['diff_bytes_per_step'] / MIB:.3f} MiB/step = "
              f"{100 * m['diff_fraction_of_shard_state']:.2f}% of the fp32 shard state ({shard / MIB:.2f} MiB: "
              f"master + exp_avg + exp_avg_sq)"
              + (f", {100 * m['diff_bytes_per_step'] / full_state_bytes:.2f}% of a baseline's full checkpoint "
                 f"({full_state_bytes / MIB:.2f} MiB incl. model)" if full_state_bytes else "")
              + f"; base {m['base_bytes_per_base'] / MIB:.2f} MiB every {args.base_interval} steps"
              + f"; diff {m['diff']}; tiers {'+'.join(m['tiers'])}")
        for line in verdict(summary):
            print(line)


def _groups(summary: dict) -> dict[str, list[str]]:
    """The baseline rows with a paired overhead, by how often they checkpoint ("every step", "K=25")."""
    groups: dict[str, list[str]] = {}
    for spec in summary:
        if spec not in ("none", "megatier") and "overhead_pct" in summary[spec]:
            k = split_spec(spec)[1]
            groups.setdefault("every step" if k in (None, 1) else f"K={k}", []).append(spec)
    return groups


def verdict(summary: dict) -> list[str]:
    """The target lines: MegaTier's overhead against TARGET_PCT, and whether it is the lowest row; then the
    same by CPU (cpu_verdict)."""
    m = summary["megatier"]
    if "overhead_pct" not in m:
        return []
    estimates = {"paired median": "overhead_pct", "of fastest": "fastest_pct"}
    lines = []
    for label, key in estimates.items():
        if key not in m:
            continue
        ok = m[key] <= TARGET_PCT
        lines.append(f"target ({label}): megatier {m[key]:+.1f}% {'<=' if ok else '>'} {TARGET_PCT}% -> "
                     f"{'MET' if ok else 'MISSED'}")
    for group, specs in _groups(summary).items():
        beaten = [sp for sp in specs if all(m[key] < summary[sp][key] for key in estimates.values()
                                            if key in m and key in summary[sp])]
        others = ", ".join(f"{sp} {summary[sp]['overhead_pct']:+.1f}% / {summary[sp].get('fastest_pct', 0.0):+.1f}%"
                           for sp in specs)
        lines.append(f"lowest against the rows checkpointing {group}: "
                     f"{'yes' if len(beaten) == len(specs) else 'no'} (paired median / of fastest: {others})")
    return lines + cpu_verdict(summary)


def cpu_verdict(summary: dict) -> list[str]:
    """MegaTier's checkpoint CPU (median over repeats) against CPU_TARGET_PCT of its training CPU, and whether
    its process CPU over the none runs' is the lowest of each group."""
    m = summary["megatier"]
    if "ckpt_cpu_pct" not in m:
        return []
    ok = m["ckpt_cpu_pct"] <= CPU_TARGET_PCT
    lines = [f"target (CPU): megatier checkpoint CPU {m['ckpt_cpu_pct']:.2f}% of training CPU "
             f"(min..max {_span(m, 'ckpt_cpu_pct', '.2f')}%) {'<=' if ok else '>'} {CPU_TARGET_PCT}% -> "
             f"{'MET' if ok else 'MISSED'}"]
    for group, specs in _groups(summary).items():
        specs = [sp for sp in specs if "cpu_overhead_pct" in summary[sp]]
        if not specs or "cpu_overhead_pct" not in m:
            continue
        lowest = all(m["cpu_overhead_pct"] < summary[sp]["cpu_overhead_pct"] for sp in specs)
        others = ", ".join(f"{sp} {summary[sp]['cpu_overhead_pct']:+.1f}%" for sp in specs)
        lines.append(f"lowest CPU against the rows checkpointing {group}: {'yes' if lowest else 'no'} "
                     f"(megatier {m['cpu_overhead_pct']:+.1f}%; {others})")
    return lines


def main(argv=None) -> int:
    if RUN_ENV in os.environ:
        return torchrun_child(json.loads(os.environ[RUN_ENV]))
    args = parse_args(argv)
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        raise SystemExit("run this script with plain python; --nproc N starts a torchrun job per run")
    own_work = args.work_dir is None
    work = args.work_dir or tempfile.mkdtemp(prefix="megatier_bench_")
    os.makedirs(work, exist_ok=True)
    dirs = {"work": work, "shm": tempfile.mkdtemp(prefix="megatier_bench_", dir=args.shm_dir)}

    import torch

    def one(row: str, tag: str, **changes) -> dict:
        return run_under_torchrun(args, row, tag, dirs, changes)

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads, world {args.nproc}"
          f" (a torchrun job per run); work dir {work}, "
          f"Tier-1 {dirs['shm']}", flush=True)
    # Untimed priming run: builds/loads the corpus and warms the allocator and the page cache.
    one("none", "prime", iters=3, warmup=0)
    runs = []
    for i, (row, rep) in enumerate(schedule(args.specs, args.repeats)):
        try:
            res = one(row, f"{i:02d}")
        except Exception as e:  # a broken row is reported as such; the other rows still run
            res = {"row": row, "tag": f"{i:02d}", "error": f"{type(e).__name__}: {e}"}
            print(f"  [{i + 1:2d}] rep {rep} {row:<22} FAILED: {res['error']}", flush=True)
        else:
            print(f"  [{i + 1:2d}] rep {rep} {row:<22} mean step {1000 * res['mean_step_s']:.1f} ms "
                  f"(stall {res['mean_stall_ms']:.2f} ms, close {res['close_s']:.1f} s), CPU {res['cpu_ms']:.1f} "
                  f"ms/step, checkpoint {res['ckpt_cpu_pct']:.2f}% of training", flush=True)
        res.update(seq=i, rep=rep)
        runs.append(res)
    full_state_bytes = next((x["bytes_per_checkpoint"] for x in runs
                             if x["row"] not in ("none", "megatier") and "error" not in x), None)
    summary = summarize(runs, args.specs)
    print_report(summary, args, full_state_bytes)
    if args.out_json:
        payload = {"args": {k: v for k, v in vars(args).items() if k != "argv"}, "torch": torch.__version__,
                   "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                   "step_time": "iter_time_s + ckpt_stall_ms, mean over steps > warmup; row = median over repeats",
                   "overhead": "median over repeats of run / mean of the none runs just before and after it",
                   "cpu": "user+sys CPU of rank 0's process from the start of step warmup+1 to the end of the loop "
                          "per step (cpu_ms); helper_cpu_ms: Python threads the checkpointer started; hook_cpu_ms: "
                          "after_step's CPU less the helpers' meanwhile; train_cpu_ms: the rest; ckpt_cpu_pct = "
                          "(helper + hook) / train; cpu_overhead_pct: cpu_ms over the none runs around the run",
                   "summary": summary, "runs": runs}
        with open(args.out_json, "w") as f:
            json.dump(payload, f, indent=2)
        print(f"wrote {args.out_json}")
    if not args.keep:
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(dirs["shm"], ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
