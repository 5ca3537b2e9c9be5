"""Router losses under pipeline parallelism (model.moe.router_loss_scope=layer): each stage adds its own MoE
layers' load-balancing and z-losses to its backward (megatier.parallel.schedules), so a pp=2 job takes the
steps of the same job at pp=1: equal losses, router figures and gradients, up to the order in which the
stages' sums are added. The pipelined run is pp=2 x dp=2 with the experts split over ep=2 and full
recomputation, which replays each block's router and all-to-alls in the backward."""
from __future__ import annotations

import pytest

from megatier.training.trainer import Trainer
from tests.distributed.configs import tiny_job
from tests.distributed.world import run_world

pytestmark = pytest.mark.timeout(180)
STEPS = 3
MODEL = dict(name="tiny_moe", arch="llama", num_layers=2, hidden_size=32, num_heads=4, num_query_groups=2,
             ffn_hidden_size=64, max_position_embeddings=32,
             moe={"num_experts": 4, "top_k": 2, "moe_ffn_hidden_size": 32, "aux_loss_coeff": 0.05,
                  "z_loss_coeff": 0.01, "router_loss_scope": "layer"})
FIGURES = ("loss", "moe_aux_loss", "moe_z_loss", "moe_tokens_per_expert_min", "moe_tokens_per_expert_max")


def _train(rank: int, tmp: str, prefix: str, pp: int, recompute: str, aux: float, ep: int = 1) -> list[dict]:
    model = {**MODEL, "recompute": recompute, "moe": {**MODEL["moe"], "aux_loss_coeff": aux}}
    cfg = tiny_job(tmp, f"moepp{pp}", prefix, iters=STEPS, pp=pp, run=f"run-pp{pp}-{aux}", model=model,
                   train={"global_batch_size": 4, "micro_batch_size": 1})
    cfg.parallel.ep = ep
    trainer = Trainer(cfg)
    records = []
    for step in range(1, STEPS + 1):
        records.append({k: v for k, v in trainer.train_step(step).items() if k in FIGURES})
        trainer.step = step
    trainer.close()
    return records


def test_a_pipelined_moe_job_with_router_losses_steps_as_one_stage(corpus_prefix, tmp_path):
    one = run_world(_train, 2, tmp_path, str(tmp_path), corpus_prefix, 1, "none", 0.05, 2, timeout_s=120)[0]
    two = run_world(_train, 4, tmp_path, str(tmp_path), corpus_prefix, 2, "full", 0.05, 2, timeout_s=150)
    # The loss is the global batch's; the router figures are pooled over the stages of rank 0's replica.
    assert len({r[0]["loss"] for r in two}) == 1 and sum(r == two[0] for r in two) == 2
    for step, (want, got) in enumerate(zip(one, two[0]), start=1):
        assert set(got) == set(FIGURES), got
        for key in FIGURES:
            assert got[key] == pytest.approx(want[key], rel=1e-6), (step, key, got[key], want[key])
    # The coefficients move the steps: a run without the load-balancing loss ends elsewhere.
    plain = run_world(_train, 1, tmp_path, str(tmp_path), corpus_prefix, 1, "none", 0.0, timeout_s=120)[0]
    assert abs(plain[-1]["loss"] - one[-1]["loss"]) > 1e-4
