#!/usr/bin/env python
"""Step time and diff bytes per step of a mixture of experts against its dense counterpart.

    python benchmarks/bench_moe.py                                  # tiny_moe against llama_tiny, 3 repeats
    python benchmarks/bench_moe.py --steps 20 --warmup 5 --repeats 3 -- data.seq_len=128

One process, the byte corpus, ``train.global_batch_size=8`` of ``train.micro_batch_size=4`` unless the overrides
say otherwise. Each model trains ``--steps`` steps with checkpointing off, and with the diff stream on
(``checkpoint=tiered`` on node memory only, lossless ``fp32`` and the ``adaptive`` codec); the models and
settings alternate within each of ``--repeats`` rounds, so the box's load falls on both alike, after a discarded
run of 2 steps (a process's first steps pay one-off costs). A run's figures:
the median over the steps after ``--warmup`` of the step time (``iter_time_s``), of the CPU time the process used
in the step (every thread's, the save thread's included; other tenants of a shared box move it far less than
wall time) and of the step's diff record (``diff_bytes``: the bytes the loop hands the save thread). The table
gives the median over repeats with min..max, and each model's parameters, total and active per token (the routed
experts' share scaled by top_k / num_experts).

The default pair has the same shape: tiny_moe is llama_tiny with each dense SwiGLU (ffn 128) replaced by 4
experts of ffn 64, each token to its top 2, so a token's active expert width (2 x 64) equals the dense width.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from typing import Optional

MODELS = ("tiny_moe", "llama_tiny")
SETTINGS = {"off": ["checkpoint.enabled=false"],
            "fp32": ["checkpoint=tiered", "checkpoint.tiers=[local]", "checkpoint.diff.compression=fp32"],
            "adaptive": ["checkpoint=tiered", "checkpoint.tiers=[local]", "checkpoint.diff.compression=adaptive"]}
COMMON = ["logging.progress=false", "logging.wandb.mode=disabled", f"train.eval_interval={10 ** 6}",
          "train.global_batch_size=8", "train.micro_batch_size=4", "checkpoint.base_interval=1000"]


def parameters(trainer) -> tuple[int, int]:
    """(total, active per token) parameters of the trainer's model."""
    total = sum(p.numel() for p in trainer.model.parameters())
    moe = trainer.cfg.model.moe
    if moe is None or not moe.num_experts:
        return total, total
    experts = sum(p.numel() for n, p in trainer.model.named_parameters() if ".experts." in n)
    return total, total - round(experts * (1 - moe.top_k / moe.num_experts))


def one_run(model: str, setting: str, overrides: list[str], steps: int, warmup: int, tmp: str) -> dict:
    """Train ``steps`` steps in this process; the medians after ``warmup`` and the model's parameters."""
    from megatier.config import compose_config
    from megatier.training.trainer import Trainer

    job = f"moebench-{uuid.uuid4().hex[:8]}"
    cfg = compose_config([f"model={model}", *COMMON, *SETTINGS[setting], *overrides, f"train.iters={steps}",
                          f"logging.run_dir={tmp}/{job}", f"checkpoint.local.root={tmp}/shm",
                          f"checkpoint.job_id={job}"])
    trainer = Trainer(cfg)
    records, step = [], trainer.train_step

    def keep(s: int) -> dict:
        cpu = time.process_time()
        records.append({**step(s), "cpu_s": time.process_time() - cpu})
        return records[-1]
    trainer.train_step = keep
    trainer.train()
    trainer.close()
    window = [r for r in records if r["step"] > warmup]
    total, active = parameters(trainer)
    return {"step_ms": 1000.0 * statistics.median(r["iter_time_s"] for r in window),
            "cpu_ms": 1000.0 * statistics.median(r["cpu_s"] for r in window),
            "diff_bytes": statistics.median(r.get("diff_bytes", 0) for r in window),
            "params": total, "active": active}


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    """The median with min..max."""
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}..{fmt.format(max(values))})"


def table(runs: dict[tuple[str, str], list[dict]]) -> str:
    lines = ["| model | params (active) | diff stream | step ms | CPU ms / step | diff bytes / step |",
             "| --- | --- | --- | --- | --- | --- |"]
    for (model, setting), rs in runs.items():
        size = f"{rs[0]['params']:,} ({rs[0]['active']:,})"
        diff = "-" if setting == "off" else spread([r["diff_bytes"] for r in rs], "{:,.0f}")
        times = " | ".join(spread([r[k] for r in rs]) for k in ("step_ms", "cpu_ms"))
        lines.append(f"| {model} | {size} | {setting} | {times} | {diff} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", nargs=2, default=list(MODELS), help="the MoE model and its dense counterpart")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = parser.parse_args(argv)
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup {args.warmup} must lie in [0, --steps {args.steps})")
    runs: dict[tuple[str, str], list[dict]] = {(m, s): [] for m in args.models for s in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        one_run(args.models[0], "off", args.overrides, 2, 0, tmp)  # discarded: the process's first steps are slow
        for repeat in range(args.repeats):
            for setting in SETTINGS:
                for model in args.models:
                    runs[(model, setting)].append(one_run(model, setting, args.overrides, args.steps, args.warmup,
                                                          tmp))
                    print(f"repeat {repeat + 1}/{args.repeats} {model} {setting}: "
                          f"{runs[(model, setting)][-1]}", file=sys.stderr, flush=True)
    print(table(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
