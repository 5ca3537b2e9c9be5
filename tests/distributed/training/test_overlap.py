"""Overlapped data-parallel communication trains bit for bit as without it (fp32, CPU, 10 steps).

Each world trains the tiny GPT twice in the same processes, once per setting, and compares every step's loss
and the final master weights, both Adam moments and the published parameters bitwise. The plain run reduces
in the default buckets (one per region of the tiny model) after backward; the overlapped one in buckets of
0.02 MiB (~5k elements), several per stage, straddling the owners' ranges, started from the gradient hooks.
Each owner sums its range in dp rank order, so at dp = 4 too the two are the same bits.
"""
from __future__ import annotations

import os
from datetime import timedelta
from typing import Optional

import pytest
import torch
import torch.distributed as dist

from megatier.training.trainer import Trainer
from tests.distributed.configs import tiny_job
from tests.distributed.training.test_expert_parallel import MODEL as MOE_MODEL
from tests.distributed.world import run_world

pytestmark = pytest.mark.timeout(180)
STEPS = 10
PLAIN: dict = {}
OVERLAPPED = {"overlap_grad_reduce": True, "overlap_param_gather": True, "bucket_mb": 0.02}
GATHER_ONLY = {"overlap_param_gather": True, "bucket_mb": 0.02}


def _train(tmp: str, prefix: str, name: str, tp: int, pp: int, sp: bool, parallel: dict,
           model: Optional[dict] = None) -> dict:
    cfg = tiny_job(tmp, name, prefix, iters=STEPS, tp=tp, pp=pp, sequence_parallel=sp, run=name, model=model)
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    trainer = Trainer(cfg)
    losses = []
    for step in range(1, STEPS + 1):
        losses.append(trainer.train_step(step)["loss"])
        trainer.step = step
    trainer.optimizer.wait_params()
    out = {"losses": losses, "params": trainer.param_flat.clone(),
           **{k: v.clone() for k, v in trainer.optimizer.state_tensors().items()},
           "buckets": len(trainer.grads.bucketed.buckets) if trainer.grads.bucketed else 0}
    trainer.close()
    return out


def _pair(rank: int, tmp: str, prefix: str, tp: int, pp: int, sp: bool, settings: list[dict],
          model: Optional[dict] = None) -> list[dict]:
    """Each setting's run in turn; a Trainer's close ends the world, so the next joins a new one."""
    out = []
    for i, setting in enumerate(settings):
        if not dist.is_initialized():
            world = int(os.environ["WORLD_SIZE"])
            dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, f"store{i}"), world), rank=rank,
                                    world_size=world, timeout=timedelta(seconds=60))
        out.append(_train(tmp, prefix, f"run{i}", tp, pp, sp, setting, model))
    return out


def _assert_bitwise(runs: list[list[dict]], a: int, b: int) -> None:
    for rank_runs in runs:
        x, y = rank_runs[a], rank_runs[b]
        assert x["losses"] == y["losses"]
        for key in ("master", "exp_avg", "exp_avg_sq", "params"):
            assert torch.equal(x[key], y[key]), key


@pytest.mark.parametrize("tp,pp,sp,world", [pytest.param(1, 1, False, 2, id="dp2"),
                                            pytest.param(1, 1, False, 4, id="dp4"),
                                            pytest.param(2, 1, False, 4, id="tp2xdp2", marks=pytest.mark.slow),
                                            pytest.param(1, 2, False, 4, id="pp2xdp2"),
                                            pytest.param(2, 1, True, 4, id="sp-tp2xdp2")])
def test_overlapped_equals_plain(corpus_prefix, tmp_path, tp, pp, sp, world):
    runs = run_world(_pair, world, tmp_path, str(tmp_path), corpus_prefix, tp, pp, sp, [PLAIN, OVERLAPPED],
                     timeout_s=170)
    assert runs[0][0]["buckets"] < runs[0][1]["buckets"] and runs[0][1]["buckets"] > 2  # several per stage
    _assert_bitwise(runs, 0, 1)


@pytest.mark.slow
def test_the_overlapped_gather_alone_equals_plain_at_dp4(corpus_prefix, tmp_path):
    runs = run_world(_pair, 4, tmp_path, str(tmp_path), corpus_prefix, 1, 1, False, [PLAIN, GATHER_ONLY],
                     timeout_s=170)
    _assert_bitwise(runs, 0, 1)


@pytest.mark.slow
def test_overlapped_equals_plain_with_routed_experts(corpus_prefix, tmp_path):
    """A mixture of experts at dp=2: the experts' region has buckets of its own, reduced after backward (over the
    expert-data-parallel group, here the dp group) and gathered like the dense region's."""
    runs = run_world(_pair, 2, tmp_path, str(tmp_path), corpus_prefix, 1, 1, False, [PLAIN, OVERLAPPED], MOE_MODEL,
                     timeout_s=170)
    _assert_bitwise(runs, 0, 1)
