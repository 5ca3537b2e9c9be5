"""Twenty fp32 steps of model.arch=llama equal transformers' LlamaForCausalLM trained by torch.optim.AdamW from the
same weights on the same batches, with the same schedule, clipping and weight-decay grouping (matrices and
embeddings decay, norms do not): at tp=1, and at tp=2 with sequence parallelism."""
from __future__ import annotations

import json
import os

import pytest
import torch

from megatier.config import ModelConfig
from megatier.training.trainer import Trainer
from tests.distributed.training.hf_reference import STEPS, adamw_losses, hf_job
from tests.distributed.world import run_world
from tests.hf_llama import save_random_llama

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

VOCAB, REL = 257, 1e-5
MODEL = dict(name="llama_t", arch="llama", num_layers=2, hidden_size=64, num_heads=4, num_query_groups=2,
             ffn_hidden_size=96, max_position_embeddings=64)


def _config(tmp: str, prefix: str, hf_dir: str, tp: int):
    return hf_job(tmp, "llama", prefix, hf_dir, tp, MODEL)


def _train(rank: int, tmp: str, prefix: str, hf_dir: str, tp: int) -> dict:
    trainer = Trainer(_config(tmp, prefix, hf_dir, tp))
    trainer.train()
    trainer.close()
    if rank != 0:
        return {}
    with open(os.path.join(trainer.cfg.logging.run_dir, "metrics.jsonl")) as f:
        losses = [r["loss"] for r in map(json.loads, f) if "event" not in r]
    return {"losses": losses, "batches": [trainer.batches.train_microbatches(s) for s in range(1, STEPS + 1)]}


def _reference(hf_dir: str, batches, cfg) -> list[float]:
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir).float().train()
    return adamw_losses(model, batches, cfg.optim,
                        lambda m, x, y: torch.nn.functional.cross_entropy(m(x).logits.flatten(0, 1), y.flatten()))


@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_llama_trains_as_hugging_face_with_adamw(tp, corpus_prefix, tmp_path):
    cfg = ModelConfig(**MODEL)
    save_random_llama(str(tmp_path / "hf"), cfg, VOCAB)
    out = run_world(_train, tp, tmp_path, str(tmp_path), corpus_prefix,
                    str(tmp_path / "hf"), tp, timeout_s=240)[0]
    want = _reference(str(tmp_path / "hf"), out["batches"], _config(str(tmp_path), corpus_prefix, "", tp))
    worst = max(abs(a - b) / abs(b) for a, b in zip(out["losses"], want))
    print(f"tp={tp}: worst relative loss difference over {STEPS} steps {worst:.2e}")
    assert len(out["losses"]) == STEPS and worst <= REL, (worst, out["losses"], want)
