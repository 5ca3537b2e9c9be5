"""Activation recomputation changes no gradient: with dropout on, at pp=2, the gradients the optimizer consumes
under model.recompute=selective and full are bitwise those of none, for both architectures."""
from __future__ import annotations

import pytest

from megatier.training.trainer import Trainer
from tests.distributed.configs import tiny_job
from tests.distributed.world import run_world

pytestmark = pytest.mark.timeout(240)
ARCHS = {"gpt2": {"num_layers": 4}, "llama": {"arch": "llama", "num_layers": 4, "num_query_groups": 2}}


def _consumed(rank: int, tmp: str, prefix: str, arch: str, recompute: str) -> dict:
    model = {**ARCHS[arch], "recompute": recompute, "hidden_dropout": 0.1, "attention_dropout": 0.1}
    trainer = Trainer(tiny_job(tmp, f"rc-{arch}-{recompute}", prefix, iters=2, pp=2, run=f"run-{arch}-{recompute}",
                               model=model))
    trainer.train()
    grad, master = trainer.optimizer.last_grad.clone(), trainer.optimizer.master.clone()
    trainer.close()
    return {"grad": grad, "master": master}


@pytest.mark.parametrize("arch", ["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def test_recomputed_gradients_are_bitwise_those_kept(arch, corpus_prefix, tmp_path):
    runs = {mode: run_world(_consumed, 2, tmp_path, str(tmp_path), corpus_prefix, arch, mode, timeout_s=180)
            for mode in ("none", "selective", "full")}
    for mode in ("selective", "full"):
        for stage, (kept, again) in enumerate(zip(runs["none"], runs[mode])):
            assert kept["grad"].equal(again["grad"]), (arch, mode, stage)
            assert kept["master"].equal(again["master"]), (arch, mode, stage)
