#!/usr/bin/env python
"""Recovery time of MegaTier: fused diff replay against its alternatives, and recovery per failure class.

Two parts (``--part replay|classes|all``, default all).

replay -- the replay of 10/50/100-step diff chains (000_*.txt section 3.3, Exp#7), in
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

classes -- recovery time per failure class. One run of ``megatier-drill``
per class (software, node, rack) on ``--nodes`` x ``--procs-per-node`` simulated
processes, killed after step ``--at-step``. MegaTier's recovery time is the record's
t_consensus + t_rollback + t_replay (each the slowest rank's, so the sum is a slight
over-estimate). The baseline is reloading the newest full checkpoint from Tier-3 and
recomputing the lost steps: (time to ``torch.load`` a full model + optimizer state of
the same model from a directory in the work dir, measured here in a world of one,
i.e. every rank's state together) + (steps since that checkpoint, with a full
checkpoint every ``--baseline-k`` steps: the failure step minus the previous multiple
of K) x (mean ``iter_time_s`` of the drill's own steps from its metrics.jsonl).
MegaTier also loses the steps between its recovery point E and the failure; the
table shows its total with those steps recomputed as well. The seed's Table 3
(GPT2 20B) is printed alongside for reference; its scale is not ours.

    python benchmarks/bench_recovery.py                               # both parts, ~3 + ~4 min on 2 cores
    python benchmarks/bench_recovery.py --part replay --chains 10,50,100 -- checkpoint.diff.compression=fp32
    python benchmarks/bench_recovery.py --part classes --at-step 39 --out-json rec.json
    python benchmarks/bench_recovery.py --quick --part replay -- data.prefix=data/mine   # a smoke run, model=tiny

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
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from megatier.config import split_overrides  # noqa: E402

PARTS = ("replay", "classes", "all")
CLASSES = ("software", "node", "rack")
MIB = 1 << 20


class Exp7(NamedTuple):
    """The seed's Exp#7 (000_*.txt section 5.3): GPT2 20B, a 100-step chain, seconds."""

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
    p.add_argument("--at-step", type=int, default=None, help="drill: the step after which the failure strikes "
                                                             "(default 19, late in a base interval of 20: the "
                                                             "base's Tier-2 replica is paced over the first 16 "
                                                             "steps, so a node failure is served from Tier-2; "
                                                             "--quick: 9)")
    p.add_argument("--baseline-k", type=int, default=50, help="baseline: a full checkpoint every K steps")
    p.add_argument("--drill-script", default=str(REPO / "scripts" / "failure_drill.py"),
                   help="the failure drill to run (tests point this at a fake)")
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
    args.at_step = args.at_step if args.at_step is not None else (9 if quick else 19)
    args.classes = [c.strip() for c in args.classes.split(",") if c.strip()]


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.chains or min(args.chains) < 1:
        p.error(f"--chains {args.chains}: give positive lengths")
    if args.warmup < 1 or args.repeats < 1 or args.baseline_k < 1 or args.at_step < 1:
        p.error("--warmup, --repeats, --baseline-k and --at-step must be >= 1")
    unknown = [c for c in args.classes if c not in CLASSES]
    if unknown:
        p.error(f"--classes: unknown {unknown}; choose from {', '.join(CLASSES)}")


def replay_overrides(args: argparse.Namespace, iters: int, run_dir: str) -> list[str]:
    """The in-process Trainer's config: ours first, the user's win, a world of one last."""
    size = (["model=tiny", "data.seq_len=64", "train.global_batch_size=4", "train.micro_batch_size=2"]
            if args.quick else ["model=small"])
    ours = size + [f"train.iters={iters}", "train.eval_iters=0", f"train.eval_interval={iters + 1}",
                   "logging.wandb.mode=disabled", "logging.progress=false", "logging.name=bench-recovery",
                   f"logging.run_dir={run_dir}", "checkpoint=disabled"]
    return ours + list(args.overrides) + ["parallel.tp=1", "parallel.pp=1"]


def drill_overrides(args: argparse.Namespace) -> list[str]:
    """The drill job's config: a base interval of 20 and a few steps left after the failure."""
    # micro-batch x dp must divide the global batch: dp is nodes x procs-per-node with tp = pp = 1.
    size = (["model=tiny", "data.seq_len=64", "train.global_batch_size=4", "train.micro_batch_size=1",
             "checkpoint.base_interval=10"] if args.quick else
            ["model=small", "train.global_batch_size=8", "train.micro_batch_size=2", "checkpoint.base_interval=20"])
    return size + [f"train.iters={args.at_step + 8}", "train.eval_iters=0", "logging.wandb.mode=disabled",
                   *args.overrides]


def compose(overrides: list[str]):
    from megatier.config import compose_config

    return compose_config(overrides, str(REPO / "configs"))


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


def time_replay(shard, base, units: list[list]) -> float:
    """Seconds to replay ``units`` (one kernel call each) onto ``base``, then publish once."""
    shard.load_base(base)  # not timed: identical for every method
    t = time.perf_counter()
    for unit in units:
        shard.replay(unit)
    shard.publish()
    return time.perf_counter() - t


def median_replay(shard, base, units: list[list], repeats: int) -> tuple[float, dict]:
    times = [time_replay(shard, base, units) for _ in range(repeats)]
    return statistics.median(times), snapshot(shard.optimizer)


def time_recompute(trainer, shard, base, start: int, chains: list[int]) -> tuple[dict, dict]:
    """Recompute from the base over the longest chain; seconds and state at each chain length."""
    shard.load_base(base)
    t = time.perf_counter()
    shard.publish()
    elapsed = time.perf_counter() - t
    laps, states = {}, {}
    for s in range(start + 1, start + max(chains) + 1):
        t = time.perf_counter()
        trainer.train_step(s)
        elapsed += time.perf_counter() - t
        if s - start in chains:
            laps[s - start], states[s - start] = elapsed, snapshot(trainer.optimizer)  # copy not timed
    return laps, states


def time_load_base(shard, base, repeats: int) -> float:
    def once() -> float:
        t = time.perf_counter()
        shard.load_base(base)
        return time.perf_counter() - t

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
                 f"{vs_seq:>9.2f}x {vs_rec:>18.1f}x   (000_*.txt Exp#7: GPT2 20B, {seed.chain} steps)")
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


# ---- classes part: the drills -------------------------------------------------------------------

def drill_command(args: argparse.Namespace, failure: str, work: str, json_path: str) -> list[str]:
    return [sys.executable, args.drill_script, "--nodes", str(args.nodes), "--procs-per-node",
            str(args.procs_per_node), "--fail", failure, "--at-step", str(args.at_step), "--work-dir", work,
            "--json", json_path, "--", *drill_overrides(args)]


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


def tail(path: str, lines: int = 20) -> str:
    with open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def mean_step_time(run_dir: Optional[str]) -> Optional[float]:
    """Mean iter_time_s over the step records of every launch's metrics file in ``run_dir``."""
    times = []
    for path in sorted(glob.glob(os.path.join(run_dir, "metrics*.jsonl"))) if run_dir else []:
        with open(path) as f:
            times += [r["iter_time_s"] for r in map(json.loads, filter(str.strip, f)) if "iter_time_s" in r]
    return statistics.fmean(times) if times else None


# ---- classes part: the baseline -----------------------------------------------------------------

def baseline_lost_steps(at_step: int, k: int) -> int:
    """Steps a full-checkpoint-every-K run recomputes after failing at ``at_step`` (back to a multiple of K)."""
    return at_step % k


def baseline_time(load_s: float, lost_steps: int, step_s: float) -> float:
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

    cfg = compose(drill_overrides(args) + [f"logging.run_dir={work}/load-run", "checkpoint=disabled",
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


def class_row(failure: str, report: dict, load: dict, k: int) -> dict:
    """One failure class's figures from its drill report and the measured full-checkpoint load."""
    rec = report["recoveries"][0]
    at_step = report.get("at_steps", [None])[0]
    step_s = mean_step_time(report.get("run_dir"))
    step_source = "drill metrics"
    if step_s is None:
        step_s, step_source = load["step_s_world1"], "measured here (world of one)"
    lost = rec.get("steps_lost_drill", rec.get("steps_lost"))
    lost = lost if lost is not None else at_step - rec["end"]
    megatier_s = rec["t_consensus_s"] + rec["t_rollback_s"] + rec["t_replay_s"]
    base_lost = baseline_lost_steps(at_step, k)
    return {"class": failure, "detected_class": rec["failure_class"], "at_step": at_step,
            "version": rec["version"], "end": rec["end"], "source_tiers": rec["source_tiers"],
            "t_consensus_s": rec["t_consensus_s"], "t_rollback_s": rec["t_rollback_s"],
            "t_replay_s": rec["t_replay_s"], "megatier_s": megatier_s, "megatier_steps_lost": lost,
            "megatier_with_rerun_s": megatier_s + lost * step_s, "bytes_tier1": rec["bytes_tier1"],
            "bytes_tier2": rec["bytes_tier2"], "bytes_tier3": rec["bytes_tier3"], "step_s": step_s,
            "step_source": step_source, "baseline_load_s": load["load_s"], "baseline_lost_steps": base_lost,
            "baseline_s": baseline_time(load["load_s"], base_lost, step_s), "final_loss": report.get("final_loss")}


def tiers_text(source_tiers: dict) -> str:
    return "+".join(f"{t}x{n}" for t, n in source_tiers.items() if n) or "-"


def format_classes_table(rows: list[dict], k: int, seed: Sequence[Table3Row] = SEED_TABLE3) -> str:
    """Per class: MegaTier's phases and total, the baseline's load + rerun, the speedup, the seed's TierCheck row."""
    head = (f"{'class':<9} {'bases from':<16} {'V->E':>8} {'consens':>8} {'rollback':>9} {'replay':>8} "
            f"{'MegaTier':>9} {'+rerun':>8} {'lost':>5} {'base load':>10} {'lost':>5} {'baseline':>9} "
            f"{'speedup':>8} | {'seed TierCheck roll/rerun/total':>31}")
    lines = [head, "-" * len(head)]
    for r in rows:
        ref = next((s for s in seed if s.system == "TierCheck" and s.failure == r["class"]), None)
        ref_text = f"{ref.rollback_s:.1f} / {ref.rerun_s:.1f} / {ref.total_s:.1f} s" if ref else "-"
        lines.append(
            f"{r['class']:<9} {tiers_text(r['source_tiers']):<16} {r['version']:>3}->{r['end']:<4} "
            f"{r['t_consensus_s']:>8.3f} {r['t_rollback_s']:>9.3f} {r['t_replay_s']:>8.3f} {r['megatier_s']:>9.3f} "
            f"{r['megatier_with_rerun_s']:>8.3f} {r['megatier_steps_lost']:>5} {r['baseline_load_s']:>10.3f} "
            f"{r['baseline_lost_steps']:>5} {r['baseline_s']:>9.3f} "
            f"{r['baseline_s'] / r['megatier_with_rerun_s']:>7.1f}x | "
            f"{ref_text:>31}")
    others = ", ".join(f"{s.system} {s.rollback_s:.1f} + {s.rerun_s:.1f} = {s.total_s:.1f} s"
                       for s in seed if s.system != "TierCheck")
    lines.append(f"seed baselines (all classes, GPT2 20B, 000_*.txt Table 3): {others}")
    lines.append(f"MegaTier = t_consensus + t_rollback + t_replay (slowest rank each); +rerun adds its lost steps x "
                 f"step time; baseline = full-state torch.load + (failure step mod K={k}) x step time; speedup = "
                 f"baseline / (MegaTier +rerun), both back at the failure step")
    return "\n".join(lines)


def run_classes(args: argparse.Namespace, work: str) -> dict:
    """The classes part: one drill per class, the baseline's load measured once; prints its table."""
    if not os.path.exists(args.drill_script):
        raise SystemExit(f"bench_recovery: the failure drill {args.drill_script} does not exist")
    rows, reports = [], {}
    for failure in args.classes:
        drill_work = os.path.join(work, f"drill-{failure}")
        json_path = os.path.join(work, f"drill-{failure}.json")
        print(f"classes: {failure} failure after step {args.at_step} on {args.nodes}x{args.procs_per_node} "
              f"processes ...", flush=True)
        t = time.perf_counter()
        reports[failure] = run_drill(drill_command(args, failure, drill_work, json_path), json_path,
                                     os.path.join(work, f"drill-{failure}.log"), args.drill_timeout_s)
        print(f"  drill done in {time.perf_counter() - t:.0f} s", flush=True)
    load = measure_full_load(args, work)
    for failure in args.classes:
        rows.append(class_row(failure, reports[failure], load, args.baseline_k))
    print()
    print(f"recovery per failure class: drill job {' '.join(drill_overrides(args))}; failure after step "
          f"{args.at_step}; full state {load['bytes'] / MIB:.1f} MiB; step time from "
          f"{rows[0]['step_source'] if rows else '-'} ({rows[0]['step_s'] * 1000 if rows else 0:.0f} ms)")
    print(format_classes_table(rows, args.baseline_k))
    return {"drill_overrides": drill_overrides(args), "at_step": args.at_step, "baseline_k": args.baseline_k,
            "full_state_bytes": load["bytes"], "rows": rows}


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
