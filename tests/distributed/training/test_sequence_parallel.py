"""Sequence parallelism changes where activations live, not what is trained: a GPT-2 job at tp=2 x pp=2 (the
sequence slices cross the pipeline's stage boundary) with dropout on trains the same losses and weights with
parallel.sequence_parallel on as off, up to float reordering."""
from __future__ import annotations

import pytest
import torch

from megatier.training.trainer import Trainer
from tests.distributed.configs import tiny_job
from tests.distributed.world import run_world

pytestmark = pytest.mark.timeout(240)


def _train(rank: int, tmp: str, prefix: str, sequence_parallel: bool) -> dict:
    name = f"sp-{sequence_parallel}"
    trainer = Trainer(tiny_job(tmp, name, prefix, iters=4, tp=2, pp=2, sequence_parallel=sequence_parallel,
                               run=f"run-{name}", model={"hidden_dropout": 0.1, "attention_dropout": 0.1}))
    trainer.train()
    master = trainer.optimizer.master.clone()
    return {"master": master, "loss": trainer.close()["loss"]}


def test_gpt2_with_sequence_parallelism_trains_as_without(corpus_prefix, tmp_path):
    runs = {sp: run_world(_train, 4, tmp_path, str(tmp_path), corpus_prefix, sp, timeout_s=200) for sp in (False, True)}
    for rank, (plain, sliced) in enumerate(zip(runs[False], runs[True])):
        assert sliced["loss"] == pytest.approx(plain["loss"], rel=1e-5), rank
        torch.testing.assert_close(sliced["master"], plain["master"], rtol=1e-5, atol=1e-6, msg=f"rank {rank}")
