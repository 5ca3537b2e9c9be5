"""Base capture: the loop's stall and the memory held, snapshot against spread (with and without a schedule).

Each run is ``torchrun --nproc-per-node N pretrain_gpt.py experiment=demo`` with
tiered checkpointing (Tier-1 under /dev/shm, Tier-3 a directory), a base every
--base-interval steps and a diff every step; the variants differ only in
``checkpoint.base_capture`` / ``capture_schedule``:

  snapshot    the whole shard copied in the loop at each base step (the reference)
  spread      capture_steps = k parts, each copied at the end of its step
  checkflow   k parts, each copied during the next step's operations, as the
              schedule solved from a profiled step places them

Variants run in alternating order, --repeats times. Per run, from rank 0's
metrics.jsonl (steps after --warmup): the loop's own capture work
(``ckpt_base_copy_ms``: copying a snapshot or a part, keeping gradient slices,
handing a base over), the whole stall (``ckpt_stall_ms``) at capture
steps (snapshot: the base step; spread: every step of a window, i.e. where a
part is copied or a base handed over) and elsewhere; the step time
(``iter_time_s``) in and out of windows (a scheduled copy runs inside the
step, so its cost, if any, shows there and not in the stall); and the most
host bytes held for capture (``ckpt_capture_bytes``; a snapshot holds the
whole shard, 12 bytes per element of it). Figures: median over repeats with
min..max.

    python benchmarks/bench_base_capture.py                       # 3 variants x 3 repeats, ~12 min on 2 cores
    python benchmarks/bench_base_capture.py --variants snapshot,checkflow --repeats 5
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {"snapshot": ["checkpoint.base_capture=snapshot"],
            "spread": ["checkpoint.base_capture=spread", "checkpoint.capture_schedule=none"],
            "checkflow": ["checkpoint.base_capture=spread", "checkpoint.capture_schedule=checkflow"]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iters", type=int, default=64)
    p.add_argument("--warmup", type=int, default=4, help="first steps left out (the profile is taken at step 2)")
    p.add_argument("--base-interval", type=int, default=10)
    p.add_argument("--capture-steps", type=int, default=4)
    p.add_argument("--nproc", type=int, default=2, help="processes (data parallel) on this host")
    p.add_argument("--out-json", default=None)
    p.add_argument("--keep", default=None, help="keep every run's directory (metrics.jsonl) under this one")
    args = p.parse_args(argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    return args


def run(args, variant: str, work: Path, tag: str) -> list[dict]:
    """One training run; rank 0's step records."""
    name = f"cap-{tag}"
    overrides = ["experiment=demo", "checkpoint=tiered", f"train.iters={args.iters}", "train.eval_interval=1000000",
                 f"checkpoint.base_interval={args.base_interval}", f"checkpoint.capture_steps={args.capture_steps}",
                 "checkpoint.tiers=[local,remote]", f"checkpoint.remote.url={work / 'remote'}",
                 f"checkpoint.local.root=/dev/shm/megatier-bench-{os.getpid()}", f"logging.name={name}",
                 f"logging.run_dir={work / name}", "logging.progress=false", "logging.wandb.mode=disabled",
                 *VARIANTS[variant]]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
           "-m", "megatier.train", *overrides]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    shutil.rmtree(f"/dev/shm/megatier-bench-{os.getpid()}", ignore_errors=True)
    with open(work / name / "metrics.jsonl") as f:
        return [r for r in map(json.loads, f) if "iter_time_s" in r]


def capture_steps(records: list[dict], variant: str) -> set[int]:
    """Steps that copy base bytes in the loop or hand a base over."""
    if variant == "snapshot":
        return {r["step"] for r in records if r.get("base_capture")}
    held = {r["step"] for r in records if r.get("ckpt_capture_bytes", 0) > 0 or r.get("base_capture")}
    return held | {s + 1 for s in held}  # a part taken at s is copied during s + 1 with a schedule


def figures(records: list[dict], variant: str, warmup: int) -> dict:
    schedule = next((r["base_capture_schedule"] for r in records if "base_capture_schedule" in r), None)
    records = [r for r in records if r["step"] > warmup]
    window = capture_steps(records, variant)
    inside = [r for r in records if r["step"] in window]
    outside = [r for r in records if r["step"] not in window]
    shard_bytes = max(r.get("base_bytes", 0) for r in records)  # an encoded base: the shard plus headers
    held = max((r.get("ckpt_capture_bytes", 0) for r in records), default=0)
    return {"capture_max_ms": max(r["ckpt_base_copy_ms"] for r in records),
            "capture_median_in_ms": statistics.median(r["ckpt_base_copy_ms"] for r in inside),
            "stall_max_in_ms": max(r["ckpt_stall_ms"] for r in inside),
            "stall_median_in_ms": statistics.median(r["ckpt_stall_ms"] for r in inside),
            "stall_median_out_ms": statistics.median(r["ckpt_stall_ms"] for r in outside),
            "step_median_in_ms": 1e3 * statistics.median(r["iter_time_s"] for r in inside),
            "step_median_out_ms": 1e3 * statistics.median(r["iter_time_s"] for r in outside),
            "held_max_mib": (held if variant != "snapshot" else shard_bytes) / 2**20,
            "shard_mib": shard_bytes / 2**20, "capture_steps": len(inside), "schedule": schedule}


def spread_of(values: list[float]) -> str:
    return f"{statistics.median(values):7.1f} ({min(values):.1f}..{max(values):.1f})"


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-capture-"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {v: [] for v in args.variants}
    try:
        for rep in range(args.repeats):
            order = args.variants if rep % 2 == 0 else args.variants[::-1]
            for variant in order:
                results[variant].append(figures(run(args, variant, work, f"{variant}-{rep}"), variant, args.warmup))
                print(f"repeat {rep} {variant}: {json.dumps(results[variant][-1])}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    keys = ["capture_max_ms", "capture_median_in_ms", "stall_max_in_ms", "stall_median_in_ms", "stall_median_out_ms",
            "step_median_in_ms",
            "step_median_out_ms", "held_max_mib"]
    print(f"\n{'variant':<10} " + " ".join(f"{k:>22}" for k in keys))
    for variant, runs in results.items():
        print(f"{variant:<10} " + " ".join(f"{spread_of([r[k] for r in runs]):>22}" for k in keys))
    for variant, runs in results.items():
        if runs and runs[0]["schedule"]:
            print(f"{variant}: {runs[0]['schedule']}")
    if "snapshot" in results and "checkflow" in results:
        for key in ("capture_max_ms", "stall_max_in_ms"):
            ratio = statistics.median(r[key] for r in results["checkflow"]) / \
                statistics.median(r[key] for r in results["snapshot"])
            print(f"{key}, checkflow / snapshot: {ratio:.2f} (target <= 0.33)")
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
