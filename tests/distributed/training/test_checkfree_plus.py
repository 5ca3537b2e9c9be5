"""model.pipeline_order=checkfree_plus: a pp=4 Trainer routes every second micro-batch the swapped way and keeps
its replicas bitwise equal to their sources (weights and both Adam moments), as the tied head is kept; a lost
first or last stage is rebuilt from its stand-in's layers and exact copies of its (de)embedding. GPT-2 and Llama
(whose untied head and word embedding have replicas of their own)."""
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
ARCHS = {"gpt2": {}, "llama": {"arch": "llama", "num_query_groups": 2}}


def _config(tmp: str, order: str, run: str = "run", checkpoint: str = "", arch: str = "gpt2") -> Config:
    """``checkpoint``: "" (off), "stop" or "checkfree" (Tier-1 in <tmp>/shm, lossless diffs, last_resort)."""
    return tiny_job(tmp, f"cfplus-{arch}", Path(tmp, "corpus.txt").read_text(), iters=STEPS, pp=4, run=run,
                    model={"name": "tiny4", "num_layers": 4, "pipeline_order": order, **ARCHS[arch]},
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


# Each replica with its source: (source stage, source, replica stage, replica).
NORM = (3, "final_norm.weight", 2, "final_norm_replica.weight")
PAIRS = {"gpt2": [(0, "pos.weight", 1, "pos_replica.weight"), NORM,
                  (3, "final_norm.bias", 2, "final_norm_replica.bias")],
         "llama": [(0, "word.weight", 1, "word_replica.weight"), NORM, (3, "head_weight", 2, "head_replica.weight")]}


def _train(rank: int, tmp: str, order: str, arch: str) -> dict:
    trainer = Trainer(_config(tmp, order, run=f"{order}-{arch}", arch=arch))
    trainer.train()
    names = [name for pair in PAIRS[arch] for name in pair[1::2]]
    out = {"state": _state(trainer, names), "loss": trainer.last_record["loss"],
           "params": sorted(n for n, _ in trainer.model.named_parameters())}
    trainer.close()
    return out


@pytest.mark.parametrize("arch", ["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def test_replicas_stay_bitwise_equal_to_their_sources(corpus_prefix, tmp_path, arch):
    (tmp_path / "corpus.txt").write_text(corpus_prefix)
    results = run_world(_train, 4, tmp_path, str(tmp_path), "checkfree_plus", arch, timeout_s=120)
    for src_rank, src, copy_rank, copy in PAIRS[arch]:
        assert copy in results[copy_rank]["params"]
        for kind, a, b in zip(("master", "exp_avg", "exp_avg_sq"), results[src_rank]["state"][src],
                              results[copy_rank]["state"][copy]):
            assert torch.equal(a, b), f"{copy} on stage {copy_rank}: {kind} differs from {src}"
        assert bool(results[src_rank]["state"][src][1].abs().sum() > 0)  # it trained
    if arch == "llama":
        return
    standard = run_world(_train, 4, tmp_path, str(tmp_path), "standard", arch, timeout_s=120)
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


def _first(rank: int, tmp: str, arch: str) -> dict:
    os.environ["MEGATIER_NODE_NAME"] = "node0"
    trainer = Trainer(_config(tmp, "checkfree_plus", "first", checkpoint="stop", arch=arch))
    trainer.train()
    out = _params(trainer)
    trainer.close()
    return out


def _again(rank: int, tmp: str, run: str, arch: str) -> dict:
    os.environ["MEGATIER_NODE_NAME"] = "node0"
    cfg = _config(tmp, "checkfree_plus", run, checkpoint="checkfree", arch=arch)
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


def _copy_of(name: str, lost: int, arch: str) -> tuple[int, str]:
    """Where a lost end stage's parameter ``name`` (not a layer) is copied from: (stage, parameter there)."""
    if arch == "gpt2" and name in ("word.weight", "head_weight"):  # the tied pair, on the other end
        return 3 - lost, "head_weight" if lost == 0 else "word.weight"
    stand_in = 1 if lost == 0 else 2
    return stand_in, "head_replica.weight" if name == "head_weight" else name.replace(".", "_replica.", 1)


# What each lost end is rebuilt with exactly: its (de)embedding and final norm.
EXACT = {("gpt2", 0): {"word.weight", "pos.weight"}, ("gpt2", 3): {"word.weight", "final_norm.weight",
                                                                   "final_norm.bias"},
         ("llama", 0): {"word.weight"}, ("llama", 3): {"final_norm.weight", "head_weight"}}


@pytest.mark.parametrize("arch,lost", [case if case == ("gpt2", 0) else pytest.param(*case, marks=pytest.mark.slow)
                                       for case in EXACT])
def test_a_lost_end_stage_is_rebuilt_from_its_stand_in(corpus_prefix, tmp_path, arch, lost):
    (tmp_path / "corpus.txt").write_text(corpus_prefix)
    tmp = str(tmp_path)
    before = run_world(_first, 4, tmp_path, tmp, arch, timeout_s=120)
    shutil.rmtree(tmp_path / "shm" / f"cfplus-{arch}" / "node0" / "own" / f"rank{lost:05d}")
    after = run_world(_again, 4, tmp_path, tmp, "again", arch, timeout_s=120)
    assert [a["step"] for a in after] == [STEPS] * 4
    rebuilt, stand_in = after[lost]["params"], 1 if lost == 0 else 2
    # Its layer is a copy of its stand-in's; its (de)embedding an exact copy of the survivors' copies.
    for name, p in rebuilt.items():
        if name.startswith("layers."):
            want = before[stand_in][name.replace(f"layers.{lost}.", f"layers.{stand_in}.")]
        else:
            stage, source = _copy_of(name, lost, arch)
            want = before[stage][source]
        assert torch.equal(p, want), name
    for stage in set(range(4)) - {lost}:
        assert all(torch.equal(p, before[stage][n]) for n, p in after[stage]["params"].items())
    assert after[lost]["moments"] == 0.0 and after[lost]["lr_scale"] == 1.1
    (rb,) = after[0]["record"]["checkfree"]["rebuilds"]
    assert rb["stand_in"] and rb["neighbours"] == [stand_in]
    assert set(rb["exact_copies"]) == EXACT[arch, lost]
