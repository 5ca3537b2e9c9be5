"""What the diff stream spends on routed experts that got no token in a step.

An expert no token of the global batch was routed to in a step has a zero gradient in that step (its
expert-data-parallel group's sum of nothing), and a step's diff record is that gradient, compressed segment by
segment. This trains a model with ``model.moe`` in one process for a few steps and, after each, counts the
(layer, expert) pairs whose gradient is all zero, and compresses the consumed gradient shard twice with the
configured codec: as the diff stream does, and without those experts' segments (what a record that skips zero
segments would weigh). Prints one JSON line per run: the counts, the record bytes per step and the share the
idle experts took.

    .venv/bin/python -m benchmarks.bench_expert_diffs --steps 20 model=tiny_moe
    .venv/bin/python -m benchmarks.bench_expert_diffs --steps 20 model=tiny_moe model.moe.num_experts=16 \\
        model.moe.top_k=1 train.global_batch_size=2 train.micro_batch_size=1 data.seq_len=32
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict

import torch

from megatier import ops
from megatier.checkpoint.shard import tiling_segments

_EXPERT = re.compile(r"^layers\.(\d+)\.moe\.experts\.(\d+)\.")


def expert_slices(segments) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """(layer, expert) -> its (offset, numel) pieces in the shard."""
    out: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for s in segments:
        m = _EXPERT.match(s.name)
        if m:
            out[(int(m.group(1)), int(m.group(2)))].append((s.shard_offset, s.numel))
    return out


def record_bytes(grad: torch.Tensor, pieces: list[tuple[int, int]], cfg) -> int:
    """Bytes of the diff record of ``grad``'s ``pieces`` (shard-local (offset, numel), in order) with the diff
    stream's codec."""
    if not pieces:
        return 0
    flat = torch.cat([grad[o:o + n] for o, n in pieces]).contiguous()
    tiles, pos = [], 0
    for _, n in pieces:
        tiles.append((pos, n))
        pos += n
    return ops.compress_segments(flat, tiles, cfg.compression, cfg.topk_ratio, cfg.small_threshold).nbytes


def measure(overrides: list[str], steps: int) -> dict:
    from megatier.config import compose_config
    from megatier.training.trainer import Trainer

    cfg = compose_config(["logging.wandb.mode=disabled", "logging.progress=false", f"train.iters={steps}",
                          *overrides])
    trainer = Trainer(cfg)
    o = trainer.optimizer
    experts = expert_slices(o.shard_segments)
    pieces = tiling_segments(o.shard_segments, o.master.numel())
    idle, full, skipped = [], [], []
    for step in range(1, steps + 1):
        trainer.train_step(step)
        trainer.step = step
        grad = o.last_grad
        zero = {k for k, sl in experts.items() if all(not bool(grad[a:a + n].any()) for a, n in sl)}
        dropped = {p for k in zero for p in experts[k]}
        idle.append(len(zero))
        full.append(record_bytes(grad, pieces, cfg.checkpoint.diff))
        skipped.append(record_bytes(grad, [p for p in pieces if p not in dropped], cfg.checkpoint.diff))
    trainer.close()
    return {"overrides": overrides, "steps": steps, "compression": cfg.checkpoint.diff.compression,
            "expert_layers": len(experts), "idle_expert_steps": sum(idle), "steps_with_idle": sum(i > 0 for i in idle),
            "record_bytes_per_step": sum(full) / steps, "without_idle_bytes_per_step": sum(skipped) / steps,
            "idle_share": 1 - sum(skipped) / sum(full)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("overrides", nargs="*", help="config overrides (a model with model.moe)")
    a = p.parse_args(argv)
    print(json.dumps(measure(a.overrides, a.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
