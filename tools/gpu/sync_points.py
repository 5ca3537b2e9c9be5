"""Where a tiered-checkpointing job makes the host wait for the GPU: every call site, with how often it synced.

    python -m tools.gpu.sync_points -- model=gpt2_124m train.precision=bf16 data.seq_len=1024
    python -m tools.gpu.sync_points --iters 12 -- ...          (first --warmup steps not counted)

A checkpointer that keeps up with training on a GPU must not sync in its per-step hook: each sync drains the
queue of kernels the training step had enqueued, so the next step starts from an idle GPU. torch's sync debug
mode warns at every synchronizing call (``.item()``, ``.cpu()``, a pageable copy, ``nonzero`` ...); this
records the Python stack of each, after the warm-up steps, and prints the sites ranked by count, with the
megatier frames that led there. Without CUDA it runs the job on the CPU and finds none (``--device cpu``: a
smoke run of the script itself).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _site(stack: list[traceback.FrameSummary]) -> tuple[str, ...]:
    """The megatier frames of a stack, innermost last (at most five), as 'module.py:line function'."""
    ours = [f for f in stack if "/megatier/" in f.filename and "/tools/gpu/" not in f.filename]
    return tuple(f"{os.path.relpath(f.filename, REPO)}:{f.lineno} {f.name}" for f in ours[-5:])


class SyncRecorder:
    """Counts sync warnings by call site while ``armed``; torch raises them in the thread that synced."""

    def __init__(self):
        self.armed = False
        self.sites: collections.Counter = collections.Counter()

    def showwarning(self, message, category, filename, lineno, file=None, line=None):
        if self.armed and "synchroniz" in str(message):
            self.sites[_site(traceback.extract_stack()[:-1])] += 1


def run(iters: int, warmup: int, device: str, overrides: list[str]) -> SyncRecorder:
    from megatier.config import compose_config
    from megatier.training.trainer import Trainer

    work = tempfile.mkdtemp(prefix="megatier-syncs-")
    recorder = SyncRecorder()
    warnings.simplefilter("always")
    warnings.showwarning = recorder.showwarning
    config = compose_config([
        "model=tiny", f"train.device={device}", f"train.iters={iters}", "train.eval_iters=0",
        f"train.eval_interval={iters + 1}", "logging.wandb.mode=disabled", "logging.progress=false",
        f"logging.run_dir={work}/run", "checkpoint=tiered", "checkpoint.tiers=[local,remote]",
        f"checkpoint.local.root={work}/shm", f"checkpoint.remote.url={work}/remote", "checkpoint.remote.fsync=false",
        "checkpoint.job_id=syncs", *overrides])
    trainer = Trainer(config)
    after_step = trainer.checkpointer.after_step

    def counted(step):  # armed from the first step past the warm-up, through the hook and the next steps
        recorder.armed = step > warmup
        return after_step(step)

    trainer.checkpointer.after_step = counted
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
    try:
        trainer.train()
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        recorder.armed = False
        trainer.close()
    return recorder


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="steps before counting (allocator, kernels, first base)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("overrides", nargs="*", help="after --: config overrides")
    args = p.parse_args(argv)
    recorder = run(args.iters, args.warmup, args.device, args.overrides)
    counted = args.iters - args.warmup
    total = sum(recorder.sites.values())
    print(f"{total} host syncs over {counted} steps on {args.device} ({total / max(counted, 1):.1f} per step), "
          f"{len(recorder.sites)} call sites")
    for site, n in recorder.sites.most_common():
        print(f"{n:6d}  {site[-1] if site else '(outside megatier)'}")
        for frame in reversed(site[:-1]):
            print(f"        from {frame}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
