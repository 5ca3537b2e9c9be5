"""The one config builder of the distributed tests: a tiny GPT job for a gloo world on CPU.

    cfg = tiny_job(tmp, "job", prefix, iters=10, tp=2, checkpoint={"base_interval": 10})

Defaults: a 3-layer GPT with hidden 32 (vocabulary padded to multiples of 128 per tp rank), AdamW at 3e-3 with
warmup 2, decay over 20 steps and clipping at 1.0, 8 samples of 32 tokens a step in micro-batches of 2, seed 5,
one CPU thread, no evaluation, no wandb. Each of ``model``, ``optim``, ``train`` and ``checkpoint`` takes the
fields to change. ``checkpoint`` None: checkpointing off; a dict: on, for job ``job``, with node memory in
``<tmp>/shm``, Tier-3 in ``<tmp>/remote``, a base every 6 steps and lossless diff batches of 2 unless it says
otherwise (``diff``, ``local``, ``remote`` and ``checkfree`` take dicts of their fields).
"""
from __future__ import annotations

import os
from typing import Optional, Union

from megatier.config import (
    CheckFreeConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    DiffStreamConfig,
    LocalTierConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RemoteTierConfig,
    TrainConfig,
    WandbConfig,
)

MODEL = dict(name="tiny3", num_layers=3, hidden_size=32, num_heads=4, max_position_embeddings=32,
             make_vocab_size_divisible_by=128)
OPTIM = dict(lr=3e-3, min_lr=3e-4, warmup_iters=2, decay_iters=20, clip_grad=1.0)
TRAIN = dict(global_batch_size=8, micro_batch_size=2, seed=5, device="cpu", threads=1, eval_interval=10**6,
             eval_iters=1)


def _checkpoint(tmp: str, job: str, fields: Optional[dict]) -> CheckpointConfig:
    if fields is None:
        return CheckpointConfig()
    c = {"enabled": True, "job_id": job, "base_interval": 6, **fields}
    nested = {"diff": (DiffStreamConfig, {"batch": 2, "compression": "fp32"}),
              "local": (LocalTierConfig, {"root": os.path.join(tmp, "shm")}),
              "remote": (RemoteTierConfig, {"url": os.path.join(tmp, "remote")}),
              "checkfree": (CheckFreeConfig, {})}
    for key, (cls, defaults) in nested.items():
        c[key] = cls(**{**defaults, **c.get(key, {})})
    return CheckpointConfig(**c)


def tiny_job(tmp: str, job: str, prefix: str, *, iters: int, tp: int = 1, pp: int = 1, sequence_parallel: bool = False,
             run: str = "run",
             seq_len: int = 32, model: Union[ModelConfig, dict, None] = None, optim: Optional[dict] = None,
             train: Optional[dict] = None, checkpoint: Optional[dict] = None) -> Config:
    """The job's Config (see the module docstring); its run directory is ``<tmp>/<run>``."""
    model_cfg = model if isinstance(model, ModelConfig) else ModelConfig(**{**MODEL, **(model or {})})
    return Config(
        model=model_cfg,
        parallel=ParallelConfig(tp=tp, pp=pp, sequence_parallel=sequence_parallel, timeout_s=60.0),
        optim=OptimConfig(**{**OPTIM, **(optim or {})}),
        data=DataConfig(prefix=prefix, seq_len=seq_len),
        train=TrainConfig(**{**TRAIN, "iters": iters, **(train or {})}),
        checkpoint=_checkpoint(tmp, job, checkpoint),
        logging=LoggingConfig(name=job, run_dir=os.path.join(tmp, run), progress=False,
                              wandb=WandbConfig(mode="disabled")),
    )
