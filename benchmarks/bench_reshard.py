"""Restore time of a resharded restore next to a same-layout restore.

    python benchmarks/bench_reshard.py --work-dir /tmp/bench_reshard --repeats 3

Trains the demo model (``experiment=demo``, ``small``) on 2 simulated nodes x 2 processes (tp=2, dp=2) to
step ``--iters`` with tiered checkpointing (lossless diffs, bases every ``--base-interval`` steps, so the
restore replays a chain), then relaunches the job on copies of its tiers, once per trial, in the same layout
and in others, with ``train.iters`` at the recovery point (the relaunch restores, writes its anchor base and
exits). Each trial reports the recovery record's phases (consensus, rollback: the base and, when resharding,
every old rank's chain; replay: the replays and the exchange between layouts) and the launch's wall time from
start to exit (process start, groups, data, model, restore, drain).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from typing import Optional, Sequence

from megatier.drill.cluster import LocalCluster
from megatier.drill.job import trainer_command

JOB = "reshard"
# (label, tp, pp): dp follows from the world of 4.
LAYOUTS = [("same layout (2,1,2)", 2, 1), ("resharded to (1,1,4)", 1, 1), ("resharded to (2,2,1)", 2, 2)]


def overrides(work: str, iters: int, base_interval: int, tp: int, pp: int) -> list[str]:
    return ["experiment=demo", "checkpoint=tiered", "train.micro_batch_size=4", f"train.iters={iters}",
            "optim.decay_iters=400", f"checkpoint.base_interval={base_interval}", "checkpoint.diff.compression=fp32",
            f"checkpoint.job_id={JOB}", f"checkpoint.local.root={work}/shm", f"checkpoint.remote.url={work}/remote",
            f"logging.run_dir={work}/run", "logging.wandb.mode=disabled", "logging.progress=false",
            f"parallel.tp={tp}", f"parallel.pp={pp}", "train.eval_interval=1000000"]


def launch(work: str, args_: list[str], timeout_s: float) -> float:
    """One launch on 2 nodes x 2 processes; its wall time. Output goes to ``<work>/launch.log``."""
    log_path = os.path.join(work, "launch.log")
    with open(log_path, "w") as log:
        saved = os.dup(1), os.dup(2)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            cluster = LocalCluster(2, 2, trainer_command(args_))
            t0 = time.perf_counter()
            cluster.start()
            status = cluster.wait(fail_grace_s=5.0, timeout_s=timeout_s)
            wall = time.perf_counter() - t0
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    if status != 0:
        raise SystemExit(f"bench_reshard: a launch failed (exit {status}); see {log_path}")
    return wall


def recovery_record(work: str) -> dict:
    with open(os.path.join(work, "run", "metrics.jsonl")) as f:
        found = [r for r in map(json.loads, f) if r.get("event") == "recovery"]
    if not found:
        raise SystemExit(f"bench_reshard: no recovery record in {work}/run/metrics.jsonl")
    return found[0]


def trial(trained: str, work: str, args: argparse.Namespace, tp: int, pp: int) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    for tier in ("shm", "remote"):
        shutil.copytree(os.path.join(trained, tier), os.path.join(work, tier))
    wall = launch(work, overrides(work, args.iters, args.base_interval, tp, pp), args.timeout_s)
    r = recovery_record(work)
    restore = r["t_consensus_s"] + r["t_rollback_s"] + r["t_replay_s"]
    return {"restore_s": restore, "consensus_s": r["t_consensus_s"], "rollback_s": r["t_rollback_s"],
            "replay_s": r["t_replay_s"], "launch_s": wall, "version": r["version"], "end": r["end"],
            "resharded": r.get("resharded"), "bytes": r["bytes_tier1"] + r["bytes_tier2"] + r["bytes_tier3"]}


def summarize(rows: Sequence[dict], key: str) -> str:
    values = [r[key] for r in rows]
    return f"{statistics.median(values):.3f} ({min(values):.3f}..{max(values):.3f})"


def format_table(results: dict[str, list[dict]], args: argparse.Namespace) -> str:
    first = next(iter(results.values()))[0]
    lines = [f"restore of the demo model (small) after {args.iters} steps on 2 nodes x 2 processes (tp=2 dp=2): "
             f"base v{first['version']}, chain to E={first['end']}, lossless; median (min..max) over "
             f"{args.repeats} relaunches, seconds",
             f"{'relaunch':<24} {'restore':>22} {'consensus':>22} {'rollback':>22} {'replay':>22} "
             f"{'launch to exit':>22}"]
    for label, rows in results.items():
        lines.append(f"{label:<24} " + " ".join(f"{summarize(rows, k):>22}" for k in
                                                ("restore_s", "consensus_s", "rollback_s", "replay_s", "launch_s")))
    return "\n".join(lines)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", required=True, help="directory for the trained job and the trials")
    p.add_argument("--iters", type=int, default=30, help="steps trained before the relaunches (the point E)")
    p.add_argument("--base-interval", type=int, default=20, help="checkpoint.base_interval (V = last base <= E)")
    p.add_argument("--repeats", type=int, default=3, help="relaunches per layout")
    p.add_argument("--timeout-s", type=float, default=600.0, help="limit for each launch")
    p.add_argument("--json", default=None, help="write every trial's figures here")
    args = p.parse_args(argv)
    if args.iters <= args.base_interval or args.repeats < 1:
        p.error("--iters must exceed --base-interval (a non-empty chain) and --repeats must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("WANDB_MODE", "disabled")
    trained = os.path.join(os.path.abspath(args.work_dir), "trained")
    if os.path.exists(trained):
        raise SystemExit(f"bench_reshard: {trained} exists; give a fresh --work-dir")
    os.makedirs(trained)
    print(f"bench_reshard: training {args.iters} steps (log {trained}/launch.log)", file=sys.stderr, flush=True)
    launch(trained, overrides(trained, args.iters, args.base_interval, 2, 1), args.timeout_s)
    results: dict[str, list[dict]] = {label: [] for label, _, _ in LAYOUTS}
    for k in range(args.repeats):  # interleaved, so drift on a noisy box hits every layout alike
        for label, tp, pp in LAYOUTS:
            print(f"bench_reshard: {label}, relaunch {k + 1}/{args.repeats}", file=sys.stderr, flush=True)
            results[label].append(trial(trained, os.path.join(args.work_dir, "trial"), args, tp, pp))
    print(format_table(results, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
