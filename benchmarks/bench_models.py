#!/usr/bin/env python
"""Step time and activation memory per model: GPT-2 against Llama, with tensor and sequence parallelism and the
three recomputation modes, side by side in one run.

    python benchmarks/bench_models.py                      # small and llama_small, 30 steps a run, 2 repeats
    python benchmarks/bench_models.py --models tiny,llama_tiny --steps 10 --repeats 1

Each variant trains ``--steps`` steps as its own torchrun job (tp=1: one process; tp=2: two), without
checkpointing; its figure is the median step time over the steps after the first five, and the table gives the
median over ``--repeats`` runs with min..max. Activation memory is what one micro-batch's forward keeps for the
backward on rank 0: the bytes of every distinct storage autograd saves (``saved_tensors_hooks``), which is what
sequence parallelism divides and recomputation drops; on a GPU also ``torch.cuda.max_memory_allocated``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

RUN_ENV = "MEGATIER_BENCH_MODELS_RUN"
VARIANTS = [  # (tp, sequence_parallel, recompute)
    (1, False, "none"), (1, False, "selective"), (1, False, "full"), (2, False, "none"), (2, True, "none"),
]


def activation_bytes(trainer) -> int:
    """Bytes autograd saves for one micro-batch's forward on this rank (distinct storages, counted once)."""
    import torch

    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    x, y = trainer.batches.train_microbatches(1)[0]
    trainer.model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = trainer.model(x.to(trainer.device), y.to(trainer.device)).float().mean()
    loss.backward()
    trainer.grads.zero()
    return sum(seen.values())


def child(spec: dict) -> int:
    """One variant inside its torchrun job; rank 0 writes its figures to spec["out"]."""
    import torch

    from megatier.config import compose_config
    from megatier.training.trainer import Trainer

    trainer = Trainer(compose_config(spec["overrides"]))
    acts = activation_bytes(trainer)
    trainer.train()
    peak = torch.cuda.max_memory_allocated() if trainer.device.type == "cuda" else None
    trainer.close()
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(trainer.cfg.logging.run_dir, "metrics.jsonl")) as f:
            steps = [r for r in map(json.loads, f) if "iter_time_s" in r]
        times = [r["iter_time_s"] for r in steps[5:]] or [r["iter_time_s"] for r in steps]
        with open(spec["out"], "w") as f:
            json.dump({"step_ms": 1000 * statistics.median(times), "activation_mib": acts / 2**20,
                       "cuda_peak_mib": peak / 2**20 if peak is not None else None}, f)
    return 0


def run(model: str, tp: int, sp: bool, recompute: str, steps: int, work: str, extra: list[str]) -> dict:
    name = f"{model}-tp{tp}{'-sp' if sp else ''}-{recompute}"
    out = os.path.join(work, f"{name}.json")
    overrides = [f"model={model}", f"parallel.tp={tp}", f"parallel.sequence_parallel={str(sp).lower()}",
                 f"model.recompute={recompute}", f"train.iters={steps}", f"train.eval_interval={steps + 1}",
                 "train.eval_iters=0", "logging.wandb.mode=disabled", "logging.progress=false",
                 f"logging.name={name}", f"logging.run_dir={os.path.join(work, name)}", *extra]
    spec = {"overrides": overrides, "out": out}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={tp}",
           os.path.abspath(__file__)]
    subprocess.run(cmd, check=True, env={**os.environ, RUN_ENV: json.dumps(spec)}, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    if RUN_ENV in os.environ:
        return child(json.loads(os.environ[RUN_ENV]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Hydra overrides go after --")
    p.add_argument("--models", default="small,llama_small")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=2)
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    work = tempfile.mkdtemp(prefix="megatier_bench_models_")
    print(f"{'model':14} {'tp':>2} {'sp':>3} {'recompute':>9} {'step ms (min..max)':>24} {'activations MiB':>15}",
          flush=True)
    for model in args.models.split(","):
        for tp, sp, recompute in VARIANTS:
            runs = [run(model, tp, sp, recompute, args.steps, work, extra) for _ in range(args.repeats)]
            ms = [r["step_ms"] for r in runs]
            cuda = runs[0]["cuda_peak_mib"]
            print(f"{model:14} {tp:>2} {'yes' if sp else 'no':>3} {recompute:>9} "
                  f"{statistics.median(ms):10.1f} ({min(ms):.1f}..{max(ms):.1f}) {runs[0]['activation_mib']:15.2f}"
                  + (f"  cuda peak {cuda:.0f} MiB" if cuda is not None else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
