"""Twenty fp32 steps of a mixture of experts (model.moe) equal transformers' MixtralForCausalLM trained by
torch.optim.AdamW from the same weights on the same batches, with the load-balancing loss in the objective
(output_router_logits, router_aux_loss_coef), the same schedule, clipping and Megatron's weight-decay grouping
(matrices and embeddings decay, norms do not): at tp=1, and at tp=2 with sequence parallelism."""
from __future__ import annotations

import json
import os

import pytest
import torch.nn.functional as F

from megatier.config import ModelConfig
from megatier.training.trainer import Trainer
from tests.distributed.training.hf_reference import STEPS, adamw_losses, hf_job
from tests.distributed.world import run_world
from tests.hf_mixtral import save_random_mixtral

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

VOCAB, REL = 257, 1e-5
MODEL = dict(name="moe_t", arch="llama", num_layers=2, hidden_size=64, num_heads=4, num_query_groups=2,
             ffn_hidden_size=96, max_position_embeddings=64,
             moe={"num_experts": 4, "top_k": 2, "moe_ffn_hidden_size": 48, "aux_loss_coeff": 0.02})


def _config(tmp: str, prefix: str, hf_dir: str, tp: int):
    return hf_job(tmp, "moe", prefix, hf_dir, tp, MODEL)


def _train(rank: int, tmp: str, prefix: str, hf_dir: str, tp: int) -> dict:
    trainer = Trainer(_config(tmp, prefix, hf_dir, tp))
    trainer.train()
    trainer.close()
    if rank != 0:
        return {}
    with open(os.path.join(trainer.cfg.logging.run_dir, "metrics.jsonl")) as f:
        steps = [r for r in map(json.loads, f) if "event" not in r]
    return {"losses": [r["loss"] for r in steps], "dropped": [r["moe_dropped_tokens"] for r in steps],
            "batches": [trainer.batches.train_microbatches(s) for s in range(1, STEPS + 1)]}


def _reference(hf_dir: str, batches, cfg) -> list[float]:
    model = transformers.MixtralForCausalLM.from_pretrained(hf_dir).float().train()
    coeff = cfg.model.moe.aux_loss_coeff

    def loss_of(m, x, y):
        out = m(x, output_router_logits=True)
        return F.cross_entropy(out.logits.flatten(0, 1), y.flatten()) + coeff * out.aux_loss

    return adamw_losses(model, batches, cfg.optim, loss_of)


@pytest.mark.parametrize("tp", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_moe_trains_as_hugging_face_mixtral_with_adamw(tp, corpus_prefix, tmp_path):
    cfg = ModelConfig(**MODEL)
    save_random_mixtral(str(tmp_path / "hf"), cfg, VOCAB)
    out = run_world(_train, tp, tmp_path, str(tmp_path), corpus_prefix, str(tmp_path / "hf"), tp, timeout_s=240)[0]
    want = _reference(str(tmp_path / "hf"), out["batches"], _config(str(tmp_path), corpus_prefix, "", tp))
    worst = max(abs(a - b) / abs(b) for a, b in zip(out["losses"], want))
    print(f"tp={tp}: worst relative loss difference over {STEPS} steps {worst:.2e}")
    assert len(out["losses"]) == STEPS and worst <= REL, (worst, out["losses"], want)
    assert out["dropped"] == [0] * STEPS  # every step's record carries the router figures; dropless
