"""model.init_from at tp=2: each rank's slices are the HF weights and the first loss is HF's."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megatier.config import ModelConfig
from megatier.slicing import full_from_shards
from megatier.training.trainer import Trainer
from tests.distributed.configs import tiny_job
from tests.distributed.world import run_world
from tests.hf_gpt2 import expected_state, hf_loss, save_random_gpt2

pytest.importorskip("transformers")

VOCAB = 257  # the byte corpus; padded to 512 rows at tp=2
MODEL = ModelConfig(name="tiny2", num_layers=2, hidden_size=32, num_heads=4, max_position_embeddings=32)


def _worker(rank: int, tmp: str, prefix: str) -> dict:
    model = dataclasses.replace(MODEL, init_from=os.path.join(tmp, "hf"))
    cfg = tiny_job(tmp, "init-from", prefix, iters=1, tp=2, model=model, train={"global_batch_size": 4})
    trainer = Trainer(cfg)
    out = {"params": {n: (p.detach().clone(), p.tp_partition_dim, p.tp_partition_stride)
                      for n, p in trainer.model.named_parameters()},
           "batches": trainer.batches.train_microbatches(1)}
    out["loss"] = trainer.train_step(1)["loss"]
    trainer.step = 1
    trainer.close()
    return out


@pytest.mark.timeout(120)
def test_tp2_trainer_starts_from_the_hf_weights(corpus_prefix, tmp_path):
    hf = save_random_gpt2(str(tmp_path / "hf"), MODEL, VOCAB)
    results = run_world(_worker, 2, tmp_path, str(tmp_path), corpus_prefix)
    for name, value in expected_state(hf, MODEL.num_layers).items():
        _, dim, stride = results[0]["params"][name]
        full = full_from_shards([res["params"][name][0] for res in results], dim, stride)
        if name == "word.weight":
            assert full.shape == (512, 32) and not full[VOCAB:].any()
            full = full[:VOCAB]
        assert torch.equal(full, value), name
    expected = hf_loss(hf, results[0]["batches"])
    for res in results:
        assert res["loss"] == pytest.approx(expected, rel=0, abs=1e-4)
