#!/usr/bin/env python
"""Recovery time of MegaTier: fused diff replay against its alternatives, and recovery per failure class.

Three parts (``--part replay|classes|modes|all``, default all). The third, ``modes``, drills software and node
failures (and, with ``--classes ...,shrink``, a node failure without a spare) at the classes part's points once
by relaunch and once in process, side by side
(:mod:`benchmarks.recovery_modes` describes it).

replay -- the replay of 10/50/100-step diff chains (TierCheck, arXiv:2605.17821: section 3.3, Exp#7), in
this process (a world of one). A Trainer of the demo model (``model=small``) trains
``--warmup`` steps; the shard is captured there (``ShardAccess.capture_base``: the
chain's base). It then trains the longest chain, recording each step's consumed
gradient exactly as the checkpoint system does (``ShardAccess.consumed()`` then
``ShardAccess.compress()`` with ``checkpoint.diff``, default adaptive), and encodes
them as diff batches of ``checkpoint.diff.batch`` steps (default 5) with
``encode_diff_batch``, as the save path does. For each chain length L, starting
from the base every time (restoring it, ``load_base``, is identical for every
method and not timed; its time is printed once):

  decode      checksum + ``decode_diff_batch`` of the chain's payloads, as a recovery
              reads them from a tier; the same for fused and sequential, so it is
              reported in its own column and NOT included in "fused" / "sequential"
  fused       one ``ShardAccess.replay(batch)`` per diff batch (N steps per kernel
              call, as recovery's replay phase does), then one ``publish()``
  sequential  one ``replay([step])`` per diff (one step per kernel call), then publish
  recompute   what a run without diffs must do: ``publish()`` the base, then
              ``trainer.train_step(s)`` (forward, backward, optimizer) for the L steps

fused and sequential are the median of ``--repeats`` runs; recompute is timed once
over the longest chain, with the lap at each shorter length (chain L's steps are the
first L of the longest). Checks, printed as max |difference|: fused against
sequential (same diffs; the fused kernel promises bitwise equality), and fused
replay of lossless fp32 diffs (recorded alongside the configured ones) against the
recomputed optimizer state, which must be 0. The fused-vs-recompute difference of
the configured (lossy) compression is printed too: that is the compression error.
The speedups are sequential / fused and recompute / (fused + decode).

classes -- recovery time per failure class (TierCheck, arXiv:2605.17821: Table 3, Exp#4), expected over failure
points spread uniformly across one base interval B (``--base-interval``, default 20). For each
class (software, node, rack) and each of ``--points`` N offsets o, spread evenly over 1..B-1
(o = 1: one step after a base, the best case; o = B-1: one step before the next, the worst;
N = 2 is TierCheck's mean of the best and the worst case), one ``megatier-drill`` run on
``--nodes`` x ``--procs-per-node`` simulated processes kills a fresh job after step B + o,
in its second interval, so a base and its chain lie behind it as in a long run (a rack
failure just after a base recovers from the one before). One drill per point rather than
several failures per drill: a relaunch re-bases at its recovery point E, and E is not known
in advance (a node failure loses 0 to 2 steps, a rack failure what Tier-3 had not yet
committed), so a second failure in the same drill would not land where intended.

MegaTier, per point:
  restore + rerun  t_consensus + t_rollback + t_replay from the recovery record (the slowest
                   rank's each, so the sum slightly over-estimates) + the steps lost (failure
                   step - E) x the step time;
  end to end       from the kill to the relaunched job past the failed step. A watch thread
                   polls the job's metrics.jsonl and the drill's output every 20 ms and
                   stamps each new line with the wall clock (the records carry none), giving
                   stop       kill (launch 0's record of the failure step: the victims kill
                              themselves right after it) -> the drill announces the relaunch
                              (the launcher notices, gives the survivors the drill's
                              --fail-grace-s, 5 s, and stops them; node/rack wipes);
                   build      -> the relaunch's metrics file appears (torchrun, imports,
                              rendezvous, process groups, data, model, optimizer);
                   ckpt init  -> its recovery record, less restore (checkpointer and tiers,
                              tiers started, the re-base at E);
                   restore    the record's consensus + rollback + replay;
                   first step -> its first step record (the step and its checkpoint stall);
                   rerun      the lost steps again x the step time (to be past the failed step).

The baseline -- a full ``torch.save`` checkpoint every ``--baseline-k`` K steps, reload,
recompute -- at the same points, as fractions of its own interval: point i of N fails
i/(N-1) x (K-1) steps after its checkpoint, (K-1)/2 on average. Its restore + rerun is the
time to ``torch.load`` a full model + optimizer state of the same model (measured here, in
a world of one: every rank's state together, from the page cache) + those steps x the step
time; its end to end adds the stop, build and first step measured for MegaTier at that
point, which a relaunch pays whatever it restores from. The step time is the mean
``iter_time_s`` over every step of every drill (the step without its checkpoint stall).

Expected = the mean over the points; speedup = baseline / MegaTier of the expected times,
against the issue's targets for restore + rerun (10x software, 8x node, 4x rack). Tables:
every point, MegaTier's expected end-to-end time part by part with the part that dominates,
and per class the expected restore + rerun and end-to-end times of both with the seed's
Table 3 (GPT2 20B; its scale is not ours) alongside.

    python benchmarks/bench_recovery.py                 # every part, ~3 + ~9 + ~12 min on 2 cores (~35 s a drill)
    python benchmarks/bench_recovery.py --part modes    # relaunch and in-process recovery side by side
    python benchmarks/bench_recovery.py --part replay --chains 10,50,100 -- checkpoint.diff.compression=fp32
    python benchmarks/bench_recovery.py --part classes --points 10 --out-json rec.json
    python benchmarks/bench_recovery.py --quick --part classes -- data.prefix=data/mine   # smoke: tiny, B=10, 2 points

Hydra overrides after ``--`` go to every run (the in-process Trainer and each
drill's job). The in-process runs are a world of one, so ``parallel.tp=1
parallel.pp=1`` is appended to theirs.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatier.config import split_overrides  # noqa: E402

PARTS = ("replay", "classes", "modes", "all")
CLASSES = ("software", "node", "rack")
TARGETS = {"software": 10.0, "node": 8.0, "rack": 4.0}  # restore + rerun speedup over the baseline (the issue)
MIB = 1 << 20


class Exp7(NamedTuple):
    """The seed's Exp#7 (TierCheck, arXiv:2605.17821: section 5.3): GPT2 20B, a 100-step chain, seconds."""

    chain: int = 100
    fused_s: float = 16.6
    sequential_s: float = 26.0
    recompute_s: float = 239.3


class Table3Row(NamedTuple):
    """One row of the seed's Table 3 (Exp#4), GPT2 20B, seconds."""

    system: str
    failure: str
    rollback_s: float
    rerun_s: float
    total_s: float


SEED_EXP7 = Exp7()
SEED_TABLE3 = (
    Table3Row("TierCheck", "software", 4.5, 4.3, 8.8),
    Table3Row("TierCheck", "node", 9.6, 8.8, 18.4),
    Table3Row("TierCheck", "rack", 18.4, 5.5, 23.9),
    Table3Row("CheckFreq", "all", 17.8, 42.9, 60.5),
    Table3Row("Gemini", "all", 15.4, 17.9, 33.3),
    Table3Row("DataStates-LLM", "all", 16.0, 19.9, 35.9),
)


# ---- arguments ----------------------------------------------------------------------------------

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    argv, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Hydra overrides for every run go after `--`.")
    p.add_argument("--part", choices=PARTS, default="all", help="which measurement to run")
    p.add_argument("--quick", action="store_true", help="model=tiny, short chains and drills (smoke runs, tests)")
    p.add_argument("--chains", default=None, help="replay chain lengths, comma-separated (default 10,50,100; "
                                                  "--quick: 5,10)")
    p.add_argument("--warmup", type=int, default=None, help="training steps before the chain's base "
                                                            "(default 10; --quick: 2)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs of fused/sequential/decode, median "
                                                             "reported (default 3; --quick: 1)")
    p.add_argument("--nodes", type=int, default=2, help="drill: simulated nodes")
    p.add_argument("--procs-per-node", type=int, default=2, help="drill: processes per node")
    p.add_argument("--classes", default=",".join(CLASSES), help="drill: failure classes, comma-separated")
    p.add_argument("--base-interval", type=int, default=None, help="drill: checkpoint.base_interval, the interval "
                                                                   "the failure points spread over (default 20; "
                                                                   "--quick: 10)")
    p.add_argument("--points", type=int, default=None, help="drill: failure points per class, spread evenly from "
                                                            "one step after a base to one step before the next, "
                                                            "one drill each (default 5; --quick: 2, the best and "
                                                            "the worst case)")
    p.add_argument("--baseline-k", type=int, default=50, help="baseline: a full checkpoint every K steps")
    p.add_argument("--drill-script", default=None,
                   help="a failure drill script to run instead of the package's megatier-drill (tests: a fake)")
    p.add_argument("--drill-timeout-s", type=float, default=1200.0, help="limit for one drill")
    p.add_argument("--work-dir", default=None, help="runs, drills and the baseline's checkpoint (default: temp)")
    p.add_argument("--keep", action="store_true", help="keep the work dir")
    p.add_argument("--out-json", default=None, help="write every figure here")
    args = p.parse_args(argv)
    args.overrides = overrides
    _fill_defaults(args)
    _check_args(p, args)
    return args


def _fill_defaults(args: argparse.Namespace) -> None:
    """Defaults that depend on --quick (None means 'not given')."""
    quick = args.quick
    args.chains = [int(c) for c in (args.chains or ("5,10" if quick else "10,50,100")).split(",") if c.strip()]
    args.warmup = args.warmup if args.warmup is not None else (2 if quick else 10)
    args.repeats = args.repeats if args.repeats is not None else (1 if quick else 3)
    args.base_interval = args.base_interval if args.base_interval is not None else (10 if quick else 20)
    args.points = args.points if args.points is not None else (2 if quick else 5)
    args.classes = [c.strip() for c in args.classes.split(",") if c.strip()]


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.chains or min(args.chains) < 1:
        p.error(f"--chains {args.chains}: give positive lengths")
    if args.warmup < 1 or args.repeats < 1 or args.baseline_k < 2:
        p.error("--warmup and --repeats must be >= 1, --baseline-k >= 2")
    if not 2 <= args.points <= args.base_interval - 1:
        p.error(f"--points {args.points}: give 2 (best and worst case) to --base-interval - 1 "
                f"({args.base_interval - 1}, every step of an interval)")
    if any(o.lstrip("+~").startswith("checkpoint.base_interval=") for o in args.overrides):
        p.error("set the drill's base interval with --base-interval (the failure points are placed in it)")
    unknown = [c for c in args.classes if c not in (*CLASSES, "shrink")]
    if unknown:
        p.error(f"--classes: unknown {unknown}; choose from {', '.join(CLASSES)} (and shrink: the modes part)")


def replay_overrides(args: argparse.Namespace, iters: int, run_dir: str) -> list[str]:
    """The in-process Trainer's config: ours first, the user's win, a world of one last."""
    size = (["model=tiny", "data.seq_len=64", "train.global_batch_size=4", "train.micro_batch_size=2"]
            if args.quick else ["model=small"])
    ours = size + [f"train.iters={iters}", "train.eval_iters=0", f"train.eval_interval={iters + 1}",
                   "logging.wandb.mode=disabled", "logging.progress=false", "logging.name=bench-recovery",
                   f"logging.run_dir={run_dir}", "checkpoint=disabled"]
    return ours + list(args.overrides) + ["parallel.tp=1", "parallel.pp=1"]


def drill_overrides(args: argparse.Namespace, iters: Optional[int]) -> list[str]:
    """The drill job's config (``iters`` None: without train.iters, for the report)."""
    # micro-batch x dp must divide the global batch: dp is nodes x procs-per-node with tp = pp = 1.
    size = (["model=tiny", "data.seq_len=64", "train.global_batch_size=4", "train.micro_batch_size=1"]
            if args.quick else ["model=small", "train.global_batch_size=8", "train.micro_batch_size=2"])
    return size + [f"checkpoint.base_interval={args.base_interval}", *([f"train.iters={iters}"] if iters else []),
                   "train.eval_iters=0", "logging.wandb.mode=disabled", *args.overrides]


def compose(overrides: list[str]):
    from megatier.config import compose_config

    return compose_config(overrides)


# ---- replay part: recording ---------------------------------------------------------------------

def snapshot(optimizer) -> dict:
    """A copy of the shard state, to compare methods after the live tensors are overwritten."""
    return {k: v.detach().clone() for k, v in optimizer.state_tensors().items()}


def max_abs_diff(a: dict, b: dict) -> float:
    """Largest |a - b| over every tensor of two shard states (0.0: bitwise equal for finite values)."""
    return max(float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in a)


def record_chain(trainer, shard, start: int, length: int, diff_cfg) -> tuple[list, list, list[float]]:
    """Train steps start+1..start+length; returns their configured diffs, lossless fp32 diffs and step times.

    The lossless copy costs one more compress per step and lets the run always check exact replay,
    whatever ``checkpoint.diff.compression`` is configured.
    """
    lossless_cfg = replace(diff_cfg, compression="fp32")
    diffs, lossless, times = [], [], []
    for s in range(start + 1, start + length + 1):
        times.append(trainer.train_step(s)["iter_time_s"])
        grad, lr, adam_step, skipped = shard.consumed()
        diffs.append(shard.compress(s, grad, lr, adam_step, skipped, diff_cfg)[0])
        lossless.append(shard.compress(s, grad, lr, adam_step, skipped, lossless_cfg)[0])
    return diffs, lossless, times


def batches(steps: list, n: int) -> list[list]:
    """Consecutive groups of ``n`` steps (the last may be shorter), aligned to the chain's base like the save path."""
    return [steps[i:i + n] for i in range(0, len(steps), n)]


def encode_chain(steps: list, n: int, layout) -> list:
    from megatier.checkpoint.format.payload import encode_diff_batch

    return [encode_diff_batch(b, job_id="bench-recovery", layout=layout) for b in batches(steps, n)]


# ---- replay part: timing ------------------------------------------------------------------------

def time_decode(payloads: list, layout) -> tuple[float, list]:
    """Seconds to verify and decode every payload (what a recovery does with the bytes a tier gave it)."""
    from megatier.checkpoint.format.payload import decode_diff_batch, verify_payload

    t = time.perf_counter()
    steps = []
    for p in payloads:
        verify_payload(p.data, p.stamp, "bench")
        steps += decode_diff_batch(p, job_id="bench-recovery", layout=layout, source="bench")
    return time.perf_counter() - t, steps


def now(shard) -> float:
    """The clock once the shard's device has finished what was queued (GPU kernels run asynchronously)."""
    if shard.optimizer.master.is_cuda:
        import torch

        torch.cuda.synchronize(shard.optimizer.master.device)
    return time.perf_counter()


def time_replay(shard, base, units: list[list]) -> float:
    """Seconds to replay ``units`` (one kernel call each) onto ``base``, then publish once."""
    shard.load_base(base)  # not timed: identical for every method
    t = now(shard)
    for unit in units:
        shard.replay(unit)
    shard.publish()
    return now(shard) - t


def median_replay(shard, base, units: list[list], repeats: int) -> tuple[float, dict]:
    times = [time_replay(shard, base, units) for _ in range(repeats)]
    return statistics.median(times), snapshot(shard.optimizer)


def time_recompute(trainer, shard, base, start: int, chains: list[int]) -> tuple[dict, dict]:
    """Recompute from the base over the longest chain; seconds and state at each chain length."""
    shard.load_base(base)
    t = now(shard)
    shard.publish()
    elapsed = now(shard) - t
    laps, states = {}, {}
    for s in range(start + 1, start + max(chains) + 1):
        t = now(shard)
        trainer.train_step(s)
        elapsed += now(shard) - t
        if s - start in chains:
            laps[s - start], states[s - start] = elapsed, snapshot(trainer.optimizer)  # copy not timed
    return laps, states


def time_load_base(shard, base, repeats: int) -> float:
    def once() -> float:
        t = now(shard)
        shard.load_base(base)
        return now(shard) - t

    return statistics.median(once() for _ in range(repeats))


def measure_chain(trainer, shard, base, diffs: list, lossless: list, chain: int, n: int, repeats: int) -> dict:
    """Every figure of one chain length except recompute (timed once for all lengths)."""

    layout = trainer.ps.plain()
    payloads = encode_chain(diffs[:chain], n, layout)
    decodes = [time_decode(payloads, layout) for _ in range(repeats)]
    steps = decodes[0][1]
    fused_s, fused = median_replay(shard, base, batches(steps, n), repeats)
    seq_s, seq = median_replay(shard, base, [[s] for s in steps], repeats)
    _, exact = median_replay(shard, base, batches(lossless[:chain], n), 1)
    return {"chain": chain, "decode_s": statistics.median(d[0] for d in decodes), "fused_s": fused_s,
            "sequential_s": seq_s, "payload_bytes": sum(p.stamp.size for p in payloads), "kernel_calls_fused":
            len(batches(steps, n)), "kernel_calls_sequential": len(steps),
            "fused_vs_sequential_maxabs": max_abs_diff(fused, seq),
            "fused_vs_sequential_master_maxabs": max_abs_diff({"m": fused["master"]}, {"m": seq["master"]}),
            "_fused": fused, "_exact": exact}


def run_replay(args: argparse.Namespace, work: str) -> dict:
    """The replay part: returns its figures (and prints its table)."""
    from megatier.checkpoint.shard import ShardAccess
    from megatier.training.trainer import Trainer

    longest = max(args.chains)
    cfg = compose(replay_overrides(args, args.warmup + longest, os.path.join(work, "replay-run")))
    trainer = Trainer(cfg)
    try:
        shard = ShardAccess(trainer.optimizer, cfg.train.global_batch_size)
        for s in range(1, args.warmup + 1):
            trainer.train_step(s)
        base = shard.capture_base(args.warmup)
        print(f"replay: model={cfg.model.name} shard {shard.numel:,} elements ({shard.nbytes / MIB:.1f} MiB state), "
              f"diff {cfg.checkpoint.diff.compression} batch {cfg.checkpoint.diff.batch}; recording {longest} "
              f"steps after {args.warmup} warm-up steps", flush=True)
        diffs, lossless, train_times = record_chain(trainer, shard, args.warmup, longest, cfg.checkpoint.diff)
        laps, recomputed = time_recompute(trainer, shard, base, args.warmup, args.chains)
        rows = []
        for chain in sorted(args.chains):
            row = measure_chain(trainer, shard, base, diffs, lossless, chain, cfg.checkpoint.diff.batch, args.repeats)
            row["recompute_s"] = laps[chain]
            row["lossless_vs_recompute_maxabs"] = max_abs_diff(row.pop("_exact"), recomputed[chain])
            row["configured_vs_recompute_maxabs"] = max_abs_diff(row.pop("_fused"), recomputed[chain])
            rows.append(row)
            print(f"  chain {chain}: fused {row['fused_s']:.3f} s, sequential {row['sequential_s']:.3f} s, "
                  f"recompute {row['recompute_s']:.2f} s", flush=True)
        out = {"model": cfg.model.name, "shard_numel": shard.numel, "diff": cfg.checkpoint.diff.compression,
               "diff_batch": cfg.checkpoint.diff.batch, "warmup": args.warmup, "repeats": args.repeats,
               "load_base_s": time_load_base(shard, base, args.repeats),
               "mean_train_step_s": statistics.fmean(train_times), "rows": rows}
    finally:
        trainer.close()
    print(format_replay_report(out))
    return out


# ---- replay part: report ------------------------------------------------------------------------

def speedups(fused_s: float, sequential_s: float, recompute_s: float, decode_s: float = 0.0) -> tuple[float, float]:
    """(sequential / fused, recompute / (fused + decode)); decode is what fused pays that recompute does not."""
    return sequential_s / fused_s, recompute_s / (fused_s + decode_s)


def format_replay_table(rows: list[dict], seed: Exp7 = SEED_EXP7) -> str:
    """The chain table, one line per chain length and the seed's Exp#7 at 100 steps as the reference."""
    head = (f"{'chain':>6} {'decode s':>9} {'fused s':>9} {'seq s':>9} {'recompute s':>12} "
            f"{'seq/fused':>10} {'recomp/(fused+dec)':>19} {'max|fused-seq|':>15} {'max|lossless-recomp|':>21}")
    lines = [head, "-" * len(head)]
    for r in rows:
        vs_seq, vs_rec = speedups(r["fused_s"], r["sequential_s"], r["recompute_s"], r["decode_s"])
        lines.append(f"{r['chain']:>6} {r['decode_s']:>9.4f} {r['fused_s']:>9.4f} {r['sequential_s']:>9.4f} "
                     f"{r['recompute_s']:>12.3f} {vs_seq:>9.2f}x {vs_rec:>18.1f}x "
                     f"{r['fused_vs_sequential_maxabs']:>15.3g} {r['lossless_vs_recompute_maxabs']:>21.3g}")
    vs_seq, vs_rec = speedups(seed.fused_s, seed.sequential_s, seed.recompute_s)
    lines.append(f"{'seed':>6} {'-':>9} {seed.fused_s:>9.1f} {seed.sequential_s:>9.1f} {seed.recompute_s:>12.1f} "
                 f"{vs_seq:>9.2f}x {vs_rec:>18.1f}x   (TierCheck Exp#7: GPT2 20B, {seed.chain} steps)")
    return "\n".join(lines)


def format_replay_report(out: dict) -> str:
    rows = out["rows"]
    worst_seq = max(r["fused_vs_sequential_maxabs"] for r in rows)
    worst_exact = max(r["lossless_vs_recompute_maxabs"] for r in rows)
    worst_lossy = max(r["configured_vs_recompute_maxabs"] for r in rows)
    return "\n".join([
        "",
        f"replay of diff chains: model={out['model']} ({out['shard_numel']:,} elements), diff {out['diff']}, "
        f"batch {out['diff_batch']}; fused/sequential/decode: median of {out['repeats']}; world of one",
        "fused = one replay() per batch + publish; seq = one replay() per step + publish; decode (checksum + "
        "decode_diff_batch) NOT included in fused/seq; recompute = publish + train_step per step; restoring the "
        f"base (load_base, {out['load_base_s'] * 1000:.2f} ms) not included anywhere",
        format_replay_table(rows),
        f"fused vs sequential: max |diff| {worst_seq:.3g} over master and both moments"
        f" ({'bitwise equal' if worst_seq == 0 else 'NOT bitwise equal'})",
        f"lossless fp32 diffs, fused replay vs recomputed optimizer state: max |diff| {worst_exact:.3g}"
        f" ({'bit for bit' if worst_exact == 0 else 'MISMATCH'})",
        f"{out['diff']} diffs, fused replay vs recomputed state: max |diff| {worst_lossy:.3g} (the compression error)",
    ])


# ---- classes part: failure points ---------------------------------------------------------------

def point_offsets(points: int, interval: int) -> list[int]:
    """Where in a base interval B the failures strike: ``points`` offsets o spread evenly over 1..B-1 (one step
    after the base, the best case, to one step before the next, the worst), both ends included."""
    span = interval - 2
    return [1 + int(i * span / (points - 1) + 0.5) for i in range(points)]


def point_fractions(points: int) -> list[float]:
    """The same points as fractions of an interval, 0 (best) to 1 (worst): where the baseline's failures strike."""
    return [i / (points - 1) for i in range(points)]


def failure_step(offset: int, interval: int) -> int:
    """The step after which a point's failure strikes: offset o into a fresh job's second base interval, so the
    first base's chain is behind it as in a long run (a rack failure just after a base needs the one before)."""
    return interval + offset


# ---- classes part: watching a drill -------------------------------------------------------------

class Tail:
    """A file's new lines as they appear, each with the wall-clock time it was first seen. Follows the path across
    a rename and re-create (the metrics logger keeps each launch's file as metrics.<n>.jsonl): every new file is
    an *incarnation*, 0 the first."""

    def __init__(self, path: str):
        self.path = path
        self.opened: list[float] = []  # when each incarnation was first seen
        self.lines: list[tuple[float, int, str]] = []  # (seen, incarnation, line)
        self._file = None
        self._inode: Optional[int] = None
        self._partial = ""

    def poll(self, now: float) -> None:
        try:
            inode = os.stat(self.path).st_ino
        except OSError:
            inode = None
        if inode is not None and inode != self._inode:
            self._read(now)  # the last lines of the file that was renamed away
            self._open(now)
        self._read(now)

    def _open(self, now: float) -> None:
        self.close()
        try:
            self._file = open(self.path, errors="replace")
        except OSError:
            return  # gone again; the next poll retries
        self._inode = os.fstat(self._file.fileno()).st_ino
        self._partial = ""
        self.opened.append(now)

    def _read(self, now: float) -> None:
        if self._file is None:
            return
        *complete, self._partial = (self._partial + self._file.read()).split("\n")
        self.lines += [(now, len(self.opened) - 1, line) for line in complete if line.strip()]

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class Watch:
    """Polls some Tails every ``poll_s`` seconds from a thread while a drill runs (``with Watch(tails): ...``)."""

    def __init__(self, tails: Sequence[Tail], poll_s: float = 0.02):
        self.tails, self.poll_s = tails, poll_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-recovery-watch", daemon=True)

    def _poll(self) -> None:
        now = time.time()
        for t in self.tails:
            t.poll(now)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._poll()

    def __enter__(self) -> "Watch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()
        for t in self.tails:
            t.close()


def _is_step(record: dict) -> bool:
    return "loss" in record and record.get("event") is None


def timeline(metrics: Tail, drill_log: Tail, at_step: int) -> Optional[dict]:
    """Wall-clock times of one failure and its recovery as the watch saw them (None if it missed any):

    kill       launch 0's record of step ``at_step`` (the victims kill themselves right after it)
    relaunch   the drill's line announcing launch 1 (after the old launch is gone and what the class loses wiped)
    built      launch 1's metrics file appears: process groups, data, model and optimizer are built
    recovered  its recovery record: the checkpointer is built and restore() done
    first      its first step record
    """
    records = [(t, k, json.loads(line)) for t, k, line in metrics.lines]

    def seen(match) -> Optional[float]:
        return next((t for t, k, r in records if match(k, r)), None)

    times = {"kill": seen(lambda k, r: k == 0 and _is_step(r) and r["step"] == at_step),
             "relaunch": next((t for t, _, line in drill_log.lines if "launch1-" in line), None),
             "built": metrics.opened[1] if len(metrics.opened) > 1 else None,
             "recovered": seen(lambda k, r: k == 1 and r.get("event") == "recovery"),
             "first": seen(lambda k, r: k == 1 and _is_step(r))}
    return times if None not in times.values() else None


def phases(times: dict, restore_s: float) -> dict:
    """The end-to-end path of one recovery in seconds, from :func:`timeline` and the record's restore time."""
    return {"stop_s": times["relaunch"] - times["kill"], "build_s": times["built"] - times["relaunch"],
            "ckpt_init_s": times["recovered"] - times["built"] - restore_s, "restore_s": restore_s,
            "first_step_s": times["first"] - times["recovered"]}


# ---- classes part: the drills -------------------------------------------------------------------

def drill_command(args: argparse.Namespace, failure: str, at_step: int, work: str, json_path: str) -> list[str]:
    drill = [args.drill_script] if args.drill_script else ["-m", "megatier.cli.drill"]
    return [sys.executable, *drill, "--nodes", str(args.nodes), "--procs-per-node",
            str(args.procs_per_node), "--fail", failure, "--at-step", str(at_step), "--work-dir", work,
            "--json", json_path, "--", *drill_overrides(args, at_step + 1)]


def run_drill(cmd: list[str], json_path: str, log_path: str, timeout_s: float) -> dict:
    """Run one drill; its JSON report, or SystemExit naming the failure and the log."""
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            raise SystemExit(f"bench_recovery: the drill ran past {timeout_s:.0f} s: {' '.join(cmd)}; see "
                             f"{log_path}") from None
    if rc != 0:
        raise SystemExit(f"bench_recovery: the failure drill exited {rc} (recovery failed or bad arguments): "
                         f"{' '.join(cmd)}\n--- last lines of {log_path} ---\n{tail(log_path)}")
    try:
        with open(json_path) as f:
            report = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit(f"bench_recovery: the drill exited 0 but its JSON {json_path} is unreadable ({e})") from e
    if not report.get("ok") or not report.get("recoveries") or report["recoveries"][0] is None:
        raise SystemExit(f"bench_recovery: the drill reports no successful recovery ({report.get('problems')}); "
                         f"see {log_path}")
    return report


def run_point(args: argparse.Namespace, work: str, failure: str, offset: int) -> tuple[dict, Optional[dict]]:
    """One drill: a ``failure`` at ``offset`` into the second base interval; its report and :func:`timeline`."""
    at_step = failure_step(offset, args.base_interval)
    name = f"drill-{failure}-o{offset}"
    drill_work, json_path, log_path = (os.path.join(work, name + ext) for ext in ("", ".json", ".log"))
    # The drill keeps its job under <work-dir>/drill (make_job) and its metrics in run/ there.
    tails = [Tail(os.path.join(drill_work, "drill", "run", "metrics.jsonl")), Tail(log_path)]
    print(f"classes: {failure} failure after step {at_step} (o={offset}) on {args.nodes}x{args.procs_per_node} "
          f"processes ...", flush=True)
    t = time.perf_counter()
    with Watch(tails):
        report = run_drill(drill_command(args, failure, at_step, drill_work, json_path), json_path, log_path,
                           args.drill_timeout_s)
    print(f"  drill done in {time.perf_counter() - t:.0f} s", flush=True)
    return report, timeline(*tails, at_step)


def tail(path: str, lines: int = 20) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def step_times(run_dir: Optional[str]) -> list[float]:
    """iter_time_s of the step records of every launch's metrics file in ``run_dir``."""
    times = []
    for path in sorted(glob.glob(os.path.join(run_dir, "metrics*.jsonl"))) if run_dir else []:
        with open(path) as f:
            times += [r["iter_time_s"] for r in map(json.loads, filter(str.strip, f)) if "iter_time_s" in r]
    return times


def mean_step_time(run_dirs: Sequence[Optional[str]]) -> Optional[float]:
    """Mean iter_time_s over every step of every drill (the same job, so one step time for all)."""
    times = [t for d in run_dirs for t in step_times(d)]
    return statistics.fmean(times) if times else None


# ---- classes part: the baseline -----------------------------------------------------------------

def baseline_rerun_steps(fraction: float, k: int) -> float:
    """Steps a full-checkpoint-every-K run recomputes when it fails ``fraction`` of the way through its K
    interval (0: right after a checkpoint, 1: K - 1 steps after it); uniform points average (K - 1) / 2."""
    return fraction * (k - 1)


def baseline_time(load_s: float, lost_steps: float, step_s: float) -> float:
    """Reload the newest full checkpoint, then recompute the steps since it."""
    return load_s + lost_steps * step_s


def measure_full_load(args: argparse.Namespace, work: str, steps: int = 4) -> dict:
    """torch.save then torch.load (timed, with the copy back into the live tensors) of a world-of-one state.

    The world-of-one state of the drill's model is every rank's state together. The file is
    freshly written, so it is read from the page cache, like MegaTier's Tier-3 directory here.
    Also times ``steps`` training steps (the first excluded), the step time when a drill's
    metrics have none.
    """
    import torch

    from benchmarks.baselines import full_state, tensor_bytes
    from megatier.training.trainer import Trainer

    cfg = compose(drill_overrides(args, steps) + [f"logging.run_dir={work}/load-run", "checkpoint=disabled",
                                                  "logging.progress=false", "parallel.tp=1", "parallel.pp=1"])
    trainer = Trainer(cfg)
    try:
        times = [trainer.train_step(s)["iter_time_s"] for s in range(1, steps + 1)]
        state = full_state(trainer.optimizer, trainer.model)
        path = os.path.join(work, "full_checkpoint.pt")
        torch.save(state, path)
        t = time.perf_counter()
        loaded = torch.load(path, map_location="cpu")
        with torch.no_grad():
            for k, v in loaded.items():
                state[k].copy_(v)
        load_s = time.perf_counter() - t
        return {"load_s": load_s, "bytes": tensor_bytes(state), "step_s_world1": statistics.fmean(times[1:])}
    finally:
        trainer.close()


# ---- classes part: figures ----------------------------------------------------------------------

def point_row(failure: str, offset: int, fraction: float, report: dict, times: Optional[dict], step_s: float,
              load_s: float, k: int) -> dict:
    """One failure point: MegaTier's restore + rerun and end to end, and the baseline's at the same fraction."""
    rec = report["recoveries"][0]
    at_step = report["at_steps"][0]
    lost = rec.get("steps_lost_drill", at_step - rec["end"])
    restore_s = rec["t_consensus_s"] + rec["t_rollback_s"] + rec["t_replay_s"]
    base_lost = baseline_rerun_steps(fraction, k)
    row = {"class": failure, "offset": offset, "fraction": fraction, "at_step": at_step,
           "detected_class": rec["failure_class"], "version": rec["version"], "end": rec["end"],
           "source_tiers": rec["source_tiers"], "t_consensus_s": rec["t_consensus_s"],
           "t_rollback_s": rec["t_rollback_s"], "t_replay_s": rec["t_replay_s"], "restore_s": restore_s,
           "steps_lost": lost, "rerun_s": lost * step_s, "restore_rerun_s": restore_s + lost * step_s,
           "bytes_tier1": rec["bytes_tier1"], "bytes_tier2": rec["bytes_tier2"], "bytes_tier3": rec["bytes_tier3"],
           "baseline_lost_steps": base_lost, "baseline_restore_rerun_s": baseline_time(load_s, base_lost, step_s),
           "times": times, "e2e_s": None, "baseline_e2e_s": None}
    if times is not None:
        row.update(phases(times, restore_s))
        common = row["stop_s"] + row["build_s"] + row["first_step_s"]  # what a baseline relaunch pays too
        # Back past the failure: the first step after restore, then the `lost` steps to step at_step + 1.
        row["e2e_s"] = common + row["ckpt_init_s"] + row["restore_rerun_s"]
        row["baseline_e2e_s"] = common + row["baseline_restore_rerun_s"]
    return row


E2E_PARTS = (("stop_s", "stop"), ("build_s", "start+build"), ("ckpt_init_s", "ckpt init"), ("restore_s", "restore"),
             ("first_step_s", "first step"), ("rerun_s", "rerun"))


def dominant(parts: dict) -> str:
    """The largest part of MegaTier's end-to-end time, with its share."""
    key, label = max(E2E_PARTS, key=lambda p: parts[p[0]])
    return f"{label} {parts[key]:.2f} s ({100 * parts[key] / sum(parts[p] for p, _ in E2E_PARTS):.0f}%)"


def class_summary(failure: str, rows: list[dict]) -> dict:
    """Expected figures of one class: means over its points (uniform over a base interval)."""
    def mean(key: str) -> float:
        return statistics.fmean(r[key] for r in rows)

    rr = [r["restore_rerun_s"] for r in rows]
    out = {"class": failure, "points": len(rows), "restore_rerun_s": mean("restore_rerun_s"),
           "best_worst_mean_s": (min(rr) + max(rr)) / 2, "baseline_restore_rerun_s": mean("baseline_restore_rerun_s"),
           "target": TARGETS[failure], "e2e_s": None, "baseline_e2e_s": None, "e2e_parts": None}
    out["speedup"] = out["baseline_restore_rerun_s"] / out["restore_rerun_s"]
    out["target_met"] = out["speedup"] >= out["target"]
    if all(r["e2e_s"] is not None for r in rows):
        out["e2e_parts"] = {key: mean(key) for key, _ in E2E_PARTS}
        out.update(e2e_s=mean("e2e_s"), baseline_e2e_s=mean("baseline_e2e_s"), dominant=dominant(out["e2e_parts"]))
        out["e2e_speedup"] = out["baseline_e2e_s"] / out["e2e_s"]
    return out


# ---- classes part: report -----------------------------------------------------------------------

def tiers_text(source_tiers: dict) -> str:
    return "+".join(f"{t}x{n}" for t, n in source_tiers.items() if n) or "-"


def _s(value: Optional[float], width: int, digits: int = 2) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def format_points_table(rows: list[dict]) -> str:
    """One line per drill: where it failed, what recovery did, the end-to-end phases, the baseline there."""
    head = (f"{'class':<9} {'o':>3} {'step':>5} {'V->E':>8} {'bases from':<16} {'lost':>4} {'restore':>8} "
            f"{'rerun':>7} {'r+r':>7} | {'stop':>6} {'build':>7} {'ckpt':>6} {'1st stp':>7} {'e2e':>7} | "
            f"{'b.lost':>6} {'b.r+r':>7} {'b.e2e':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['class']:<9} {r['offset']:>3} {r['at_step']:>5} {r['version']:>3}->{r['end']:<4} "
            f"{tiers_text(r['source_tiers']):<16} {r['steps_lost']:>4} {r['restore_s']:>8.3f} {r['rerun_s']:>7.3f} "
            f"{r['restore_rerun_s']:>7.3f} | {_s(r.get('stop_s'), 6)} {_s(r.get('build_s'), 7)} "
            f"{_s(r.get('ckpt_init_s'), 6)} {_s(r.get('first_step_s'), 7)} {_s(r['e2e_s'], 7)} | "
            f"{r['baseline_lost_steps']:>6.1f} {r['baseline_restore_rerun_s']:>7.3f} {_s(r['baseline_e2e_s'], 7)}")
    return "\n".join(lines)


def format_phases_table(summaries: list[dict]) -> str:
    """MegaTier's expected end-to-end time per class, part by part, and what dominates it."""
    head = (f"{'class':<9} " + " ".join(f"{label:>11}" for _, label in E2E_PARTS) + f" {'total':>8}  dominated by")
    lines = [head, "-" * len(head)]
    for s in summaries:
        if s["e2e_parts"] is None:
            lines.append(f"{s['class']:<9} (no timeline: the watch missed a launch's metrics or the drill's lines)")
            continue
        parts = " ".join(f"{s['e2e_parts'][key]:>11.2f}" for key, _ in E2E_PARTS)
        lines.append(f"{s['class']:<9} {parts} {s['e2e_s']:>8.2f}  {s['dominant']}")
    return "\n".join(lines)


def format_summary_table(summaries: list[dict], seed: Sequence[Table3Row] = SEED_TABLE3) -> str:
    """Per class: expected restore + rerun of both systems against the target, end to end, the seed's Table 3."""
    head = (f"{'class':<9} {'pts':>3} {'MegaTier r+r':>12} {'(b+w)/2':>8} {'baseline r+r':>12} {'speedup':>8} "
            f"{'target':>11} | {'MegaTier e2e':>12} {'baseline e2e':>12} {'speedup':>8} | "
            f"{'seed TierCheck roll/rerun/total':>31}")
    lines = [head, "-" * len(head)]
    for s in summaries:
        ref = next((r for r in seed if r.system == "TierCheck" and r.failure == s["class"]), None)
        ref_text = f"{ref.rollback_s:.1f} / {ref.rerun_s:.1f} / {ref.total_s:.1f} s" if ref else "-"
        e2e_speedup = f"{s['e2e_speedup']:>7.2f}x" if s["e2e_s"] is not None else f"{'-':>8}"
        lines.append(
            f"{s['class']:<9} {s['points']:>3} {s['restore_rerun_s']:>10.3f} s {s['best_worst_mean_s']:>6.3f} s "
            f"{s['baseline_restore_rerun_s']:>10.3f} s {s['speedup']:>7.1f}x "
            f"{s['target']:>4.0f}x {'met' if s['target_met'] else 'MISSED':>6} | {_s(s['e2e_s'], 10)} s "
            f"{_s(s['baseline_e2e_s'], 10)} s {e2e_speedup} | {ref_text:>31}")
    others = ", ".join(f"{r.system} {r.rollback_s:.1f} + {r.rerun_s:.1f} = {r.total_s:.1f} s"
                       for r in seed if r.system != "TierCheck")
    lines.append(f"seed baselines (all classes, GPT2 20B, TierCheck, arXiv:2605.17821: Table 3): {others}")
    return "\n".join(lines)


POINTS_LEGEND = (
    "per failure point (seconds): restore = t_consensus + t_rollback + t_replay (slowest rank each); rerun = lost x "
    "step; e2e phases: stop = kill -> relaunch (launcher notices, survivors' --fail-grace-s, teardown), build = "
    "relaunch -> metrics logger up (torchrun, imports, process groups, data, model, optimizer), ckpt = -> recovery "
    "record less restore (checkpointer, tiers, re-base), 1st stp = -> first step record; e2e = stop + build + ckpt + "
    "restore + 1st stp + rerun (back past the failed step); b.* = baseline, a full checkpoint every K={k} steps")
SUMMARY_LEGEND = (
    "expected per class = mean over the points, uniform over one base interval ((b+w)/2 = mean of the best and the "
    "worst, TierCheck's Table 3 definition); baseline r+r = torch.load + (K-1)/2 x step on average (point i of N "
    "fails i/(N-1) x (K-1) steps after its checkpoint); baseline e2e = stop + build + 1st stp (measured, MegaTier's) "
    "+ baseline r+r; speedup = baseline / MegaTier; target = the issue's restore + rerun speedup")


def format_classes_report(out: dict) -> str:
    return "\n".join([
        "",
        f"recovery per failure class: drill job {' '.join(out['drill_overrides'])}; base interval "
        f"{out['base_interval']}; one drill per point, failing after step {out['base_interval']} + o for o in "
        f"{out['offsets']}; full state {out['full_state_bytes'] / MIB:.1f} MiB, torch.load {out['baseline_load_s']:.3f}"
        f" s; step {out['step_s'] * 1000:.0f} ms ({out['step_source']})",
        "",
        textwrap.fill(POINTS_LEGEND.format(k=out["baseline_k"]), 120),
        format_points_table(out["points"]),
        "",
        "MegaTier end to end, expected per class (mean over points, seconds):",
        format_phases_table(out["classes"]),
        "",
        textwrap.fill(SUMMARY_LEGEND, 120),
        format_summary_table(out["classes"]),
    ])


def run_classes(args: argparse.Namespace, work: str) -> dict:
    """The classes part: one drill per class and failure point, the baseline's load measured once; prints tables."""
    if args.drill_script and not os.path.exists(args.drill_script):
        raise SystemExit(f"bench_recovery: the failure drill {args.drill_script} does not exist")
    offsets = point_offsets(args.points, args.base_interval)
    classes = [c for c in args.classes if c in CLASSES]
    drills = [(failure, o, f, *run_point(args, work, failure, o))
              for failure in classes for o, f in zip(offsets, point_fractions(args.points))]
    load = measure_full_load(args, work)
    step_s, step_source = mean_step_time([d[3].get("run_dir") for d in drills]), "the drills' mean iter_time_s"
    if step_s is None:
        step_s, step_source = load["step_s_world1"], "measured here, world of one"
    rows = [point_row(*d, step_s, load["load_s"], args.baseline_k) for d in drills]
    out = {"drill_overrides": drill_overrides(args, None), "base_interval": args.base_interval, "offsets": offsets,
           "baseline_k": args.baseline_k, "full_state_bytes": load["bytes"], "baseline_load_s": load["load_s"],
           "step_s": step_s, "step_source": step_source, "points": rows,
           "classes": [class_summary(c, [r for r in rows if r["class"] == c]) for c in classes]}
    print(format_classes_report(out))
    return out


# ---- main ---------------------------------------------------------------------------------------

def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    work = os.path.abspath(args.work_dir or tempfile.mkdtemp(prefix="megatier_bench_recovery_"))
    os.makedirs(work, exist_ok=True)
    import torch

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads; work dir {work}",
          flush=True)
    result = {"args": {k: v for k, v in vars(args).items()}, "torch": torch.__version__, "cpus": os.cpu_count(),
              "seed_exp7": SEED_EXP7._asdict(), "seed_table3": [r._asdict() for r in SEED_TABLE3]}
    try:
        if args.part in ("replay", "all"):
            result["replay"] = run_replay(args, work)
        if args.part in ("classes", "all"):
            result["classes"] = run_classes(args, work)
        if args.part in ("modes", "all"):
            from benchmarks.recovery_modes import run_modes

            result["modes"] = run_modes(args, work, sys.modules[__name__])
    finally:
        if not args.keep and args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
