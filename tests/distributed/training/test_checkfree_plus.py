"""model.pipeline_order=checkfree_plus: a pp=4 Trainer routes every second micro-batch the swapped way and keeps
its replicas bitwise equal to their sources (weights and both Adam moments), as the tied head is kept; a lost
first or last stage is rebuilt from its stand-in's layers and exact copies of its (de)embedding."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from megatier.config import (
    Config,
    ConfigError,
    validate,
)
from megatier.training.trainer import Trainer
from tests.distributed.configs import tiny_job
from tests.distributed.world import run_world

pytestmark = pytest.mark.timeout(240)
STEPS = 4


def _config(tmp: str, order: str, run: str = "run", checkpoint: str = "") -> Config:
    """``checkpoint``: "" (off), "stop" or "checkfree" (Tier-1 in <tmp>/shm, lossless diffs, last_resort)."""
    return tiny_job(tmp, "cfplus", Path(tmp, "corpus.txt").read_text(), iters=STEPS, pp=4, run=run,
                    model={"name": "tiny4", "num_layers": 4, "pipeline_order": order},
                    checkpoint={"tiers": ["local"], "base_interval": 4, "last_resort": checkpoint} if checkpoint
                    else None)

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


def _params(trainer: Trainer) -> dict:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _first(rank: int, tmp: str) -> dict:
    os.environ["MEGATIER_NODE_NAME"] = "node0"
    trainer = Trainer(_config(tmp, "checkfree_plus", "first", checkpoint="stop"))
    trainer.train()
    out = _params(trainer)
    trainer.close()
    return out


def _again(rank: int, tmp: str, run: str) -> dict:
    os.environ["MEGATIER_NODE_NAME"] = "node0"
    cfg = _config(tmp, "checkfree_plus", run, checkpoint="checkfree")
    cfg.train.iters = STEPS + 2
    trainer = Trainer(cfg)
    trainer.restore()
    o = trainer.optimizer
    out = {"step": trainer.step, "params": _params(trainer), "moments": float(o.exp_avg.abs().sum()),
           "lr_scale": o.lr_scale}
    trainer.train()
    trainer.close()
    if rank == 0:
        with open(os.path.join(tmp, run, "metrics.jsonl")) as f:
            out["record"] = next(r for r in map(json.loads, f) if r.get("event") == "recovery")
    return out


@pytest.mark.parametrize("lost", [0, 3])
def test_a_lost_end_stage_is_rebuilt_from_its_stand_in(corpus_prefix, tmp_path, lost):
    (tmp_path / "corpus.txt").write_text(corpus_prefix)
    tmp = str(tmp_path)
    before = run_world(_first, 4, tmp_path, tmp, timeout_s=120)
    shutil.rmtree(tmp_path / "shm" / "cfplus" / "node0" / "own" / f"rank{lost:05d}")
    after = run_world(_again, 4, tmp_path, tmp, "again", timeout_s=120)
    assert [a["step"] for a in after] == [STEPS] * 4
    rebuilt, stand_in = after[lost]["params"], 1 if lost == 0 else 2
    # Its layer is a copy of its stand-in's; its (de)embedding an exact copy of the survivors' copies.
    for name, p in rebuilt.items():
        if name.startswith("layers."):
            want = before[stand_in][name.replace(f"layers.{lost}.", f"layers.{stand_in}.")]
        elif name in ("word.weight", "head_weight"):
            want = before[3 - lost]["head_weight" if lost == 0 else "word.weight"]
        else:
            want = before[stand_in][name.replace(".", "_replica.", 1)]
        assert torch.equal(p, want), name
    for stage in set(range(4)) - {lost}:
        assert all(torch.equal(p, before[stage][n]) for n, p in after[stage]["params"].items())
    assert after[lost]["moments"] == 0.0 and after[lost]["lr_scale"] == 1.1
    (rb,) = after[0]["record"]["checkfree"]["rebuilds"]
    assert rb["stand_in"] and rb["neighbours"] == [stand_in]
    assert set(rb["exact_copies"]) == ({"word.weight", "pos.weight"} if lost == 0 else
                                       {"word.weight", "final_norm.weight", "final_norm.bias"})
