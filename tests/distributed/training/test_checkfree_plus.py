"""model.pipeline_order=checkfree_plus: a pp=4 Trainer routes every second micro-batch the swapped way and keeps
its replicas bitwise equal to their sources (weights and both Adam moments), as the tied head is kept."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from megatier.config import (
    Config,
    ConfigError,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    WandbConfig,
    validate,
)
from megatier.training.trainer import Trainer
from tests.distributed.world import run_world

pytestmark = pytest.mark.timeout(240)
STEPS = 4


def _config(tmp: str, order: str, run: str = "run") -> Config:
    return Config(
        model=ModelConfig(name="tiny4", num_layers=4, hidden_size=32, num_heads=4, max_position_embeddings=32,
                          pipeline_order=order),
        parallel=ParallelConfig(tp=1, pp=4, timeout_s=60.0),
        optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_iters=2, decay_iters=20, clip_grad=1.0),
        data=DataConfig(prefix=Path(tmp, "corpus.txt").read_text(), seq_len=32),
        train=TrainConfig(iters=STEPS, global_batch_size=8, micro_batch_size=2, seed=5, device="cpu", threads=1,
                          eval_interval=10**6, eval_iters=1),
        logging=LoggingConfig(name="cfplus", run_dir=os.path.join(tmp, run), progress=False,
                              wandb=WandbConfig(mode="disabled")),
    )


def _state(trainer: Trainer, names: list[str]) -> dict:
    """name -> (master, exp_avg, exp_avg_sq) of this rank's parameters ``names`` (dp = 1: the shard is whole)."""
    o = trainer.optimizer
    out = {}
    for seg in o.shard_segments:
        if seg.name in names:
            cut = slice(seg.shard_offset, seg.shard_offset + seg.numel)
            out[seg.name] = tuple(t[cut].clone() for t in (o.master, o.exp_avg, o.exp_avg_sq))
    return out


def _train(rank: int, tmp: str, order: str) -> dict:
    trainer = Trainer(_config(tmp, order, run=order))
    trainer.train()
    names = ["pos.weight", "pos_replica.weight", "final_norm.weight", "final_norm.bias", "final_norm_replica.weight",
             "final_norm_replica.bias"]
    out = {"state": _state(trainer, names), "loss": trainer.last_record["loss"],
           "params": sorted(n for n, _ in trainer.model.named_parameters())}
    trainer.close()
    return out


def test_replicas_stay_bitwise_equal_to_their_sources(corpus_prefix, tmp_path):
    (tmp_path / "corpus.txt").write_text(corpus_prefix)
    results = run_world(_train, 4, tmp_path, str(tmp_path), "checkfree_plus", timeout_s=120)
    assert "pos_replica.weight" in results[1]["params"]
    assert "final_norm_replica.weight" in results[2]["params"]
    pairs = [(0, "pos.weight", 1, "pos_replica.weight"), (3, "final_norm.weight", 2, "final_norm_replica.weight"),
             (3, "final_norm.bias", 2, "final_norm_replica.bias")]
    for src_rank, src, copy_rank, copy in pairs:
        for kind, a, b in zip(("master", "exp_avg", "exp_avg_sq"), results[src_rank]["state"][src],
                              results[copy_rank]["state"][copy]):
            assert torch.equal(a, b), f"{copy} on stage {copy_rank}: {kind} differs from {src}"
        assert bool(results[src_rank]["state"][src][1].abs().sum() > 0)  # it trained

    standard = run_world(_train, 4, tmp_path, str(tmp_path), "standard", timeout_s=120)
    assert all("replica" not in n for r in standard for n in r["params"])
    assert standard[0]["loss"] != results[0]["loss"]  # the swapped micro-batches train another function


def test_checkfree_plus_needs_four_stages_and_equal_stages(corpus_prefix, tmp_path):
    (tmp_path / "corpus.txt").write_text(corpus_prefix)
    cfg = _config(str(tmp_path), "checkfree_plus")
    cfg.parallel.pp = 2
    with pytest.raises(ConfigError, match="needs parallel.pp >= 4"):
        validate(cfg, world_size=2)
    cfg = _config(str(tmp_path), "checkfree_plus")
    cfg.model.num_layers = 6
    with pytest.raises(ConfigError, match="model.num_layers=6 must be divisible by parallel.pp=4"):
        validate(cfg, world_size=4)
    cfg = _config(str(tmp_path), "checkfree_plus")
    cfg.train.global_batch_size = 2
    with pytest.raises(ConfigError, match="each rank gets 1"):
        validate(cfg, world_size=4)
