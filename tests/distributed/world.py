"""Run a function in a world of spawned gloo processes on CPU and collect what each rank returns.

    results = run_world(worker, 4, tmp_path, arg1, arg2)   # worker(rank, arg1, arg2) -> picklable

Each process gets a fresh default group over a FileStore in ``tmp_path`` (no
ports to race for), one torch thread, and torchrun-like RANK/WORLD_SIZE/
LOCAL_RANK variables so code that reads them (the Trainer) sees this world.
Workers build their own parallel groups. An exception in any worker fails the
call with that worker's traceback; a hung collective fails after ``timeout_s``.
"""
from __future__ import annotations

import os
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, fn: Callable, world_size: int, store_path: str, out_dir: str, timeout_s: float,
            args: tuple) -> None:
    torch.set_num_threads(1)  # two shared cores: never oversubscribe
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), WANDB_MODE="disabled")
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    try:
        result = fn(rank, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn: Callable, world_size: int, tmp_path: Path, *args: Any, timeout_s: float = 60.0) -> list:
    """``fn(rank, *args)`` on ``world_size`` processes; their return values in rank order."""
    run = tmp_path / f"world-{uuid.uuid4().hex[:8]}"
    run.mkdir()
    mp.start_processes(_worker, args=(fn, world_size, str(run / "store"), str(run), timeout_s, args),
                       nprocs=world_size, join=True, start_method="spawn")
    return [torch.load(run / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
