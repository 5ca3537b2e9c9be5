"""The interleaved 1F1B schedule (parallel.virtual_stages=2) trains as plain 1F1B (fp32, CPU, 10 steps).

Each world trains a 4-layer tiny GPT twice in the same processes, plain pp=2 and pp=2 x v=2, and compares every
step's loss, the validation loss, the gradient norm (to float64 rounding: see the test) and the canonical
digest of the optimizer state (master weights and both Adam moments by parameter name: the ranks hold other
layers in the two runs), at pp=2, tp=2 x pp=2 with sequence parallelism and full recomputation, and pp=2 x dp=2
with overlapped gradient reduction and parameter gather. No dropout: one generator per rank draws the masks in
the order the rank runs its layers, which interleaving changes.
"""
from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatier.training.trainer import Trainer
from tests.distributed.configs import tiny_job
from tests.distributed.world import run_world

pytestmark = pytest.mark.timeout(120)  # 6-25 s each on an idle 2-core box
STEPS = 10
MODEL = {"num_layers": 4}
# A Llama mixture of experts: each model chunk adds its own MoE layer's router losses (router_loss_scope=layer).
MOE = dict(name="tiny_moe", arch="llama", hidden_size=32, num_heads=4, num_query_groups=2, ffn_hidden_size=64,
           max_position_embeddings=32, moe={"num_experts": 4, "top_k": 2, "moe_ffn_hidden_size": 32,
                                            "aux_loss_coeff": 0.05, "z_loss_coeff": 0.01, "router_loss_scope": "layer"})


def _train(tmp: str, prefix: str, name: str, tp: int, sp: bool, v: int, recompute: str, parallel: dict) -> dict:
    model = {**MODEL, **parallel.pop("model", {}), "recompute": recompute}
    cfg = tiny_job(tmp, name, prefix, iters=STEPS, tp=tp, pp=2, sequence_parallel=sp, run=name, model=model)
    for key, value in {**parallel, "virtual_stages": v}.items():
        setattr(cfg.parallel, key, value)
    trainer = Trainer(cfg)
    losses, bubbles, norms = [], [], []
    for step in range(1, STEPS + 1):
        record = trainer.train_step(step)
        losses.append(record["loss"])
        bubbles.append(record["pp_bubble_ms"])
        norms.append(record["grad_norm"])
        trainer.step = step
    out = {"losses": losses, "val": trainer.evaluate(), "digest": trainer.canonical_digest(), "bubbles": bubbles,
           "norms": norms, "layers": sorted(int(i) for i in trainer.model.layers)}
    trainer.close()
    return out


def _pair(rank: int, tmp: str, prefix: str, tp: int, sp: bool, recompute: str, parallel: dict) -> list[dict]:
    """Plain then interleaved; a Trainer's close ends the world, so the second joins a new one."""
    out = []
    for v in (1, 2):
        if not dist.is_initialized():
            world = int(os.environ["WORLD_SIZE"])
            dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, f"store{v}"), world), rank=rank,
                                    world_size=world, timeout=timedelta(seconds=60))
        out.append(_train(tmp, prefix, f"v{v}", tp, sp, v, recompute, dict(parallel)))
    return out


@pytest.mark.parametrize("tp,sp,recompute,parallel,world", [
    (1, False, "none", {}, 2), pytest.param(2, True, "full", {}, 4, marks=pytest.mark.slow),
    pytest.param(1, False, "none", {"overlap_grad_reduce": True, "overlap_param_gather": True, "bucket_mb": 0.02}, 4,
                 marks=pytest.mark.slow)],
    ids=["pp2", "sp-tp2xpp2-recompute", "pp2xdp2-overlap"])
def test_interleaved_equals_plain_1f1b(corpus_prefix, tmp_path, tp, sp, recompute, parallel, world):
    runs = run_world(_pair, world, tmp_path, str(tmp_path), corpus_prefix, tp, sp, recompute, parallel,
                     timeout_s=55)
    plain, interleaved = runs[0]
    assert plain["layers"] == [0, 1] and interleaved["layers"] == [0, 2]  # chunk c of rank 0: layer 2c
    assert runs[-1][1]["layers"] == [1, 3]  # the last rank: chunk c holds layer 2c + 1
    assert interleaved["losses"] == plain["losses"]
    # The job's squared gradient norm is each rank's float64 sum over its layers, summed over ranks: rank 0 sums
    # layers {0, 2} instead of {0, 1}, so the norm differs in its last bits; the clip factor taken from it rounds
    # to the same float32 multiplier, so the weights are equal bitwise (the digest below).
    assert interleaved["norms"] == pytest.approx(plain["norms"], rel=1e-14, abs=0)
    assert interleaved["val"] == plain["val"]
    assert interleaved["digest"] == plain["digest"]
    assert all(b >= 0.0 for rank in runs for b in rank[1]["bubbles"])


@pytest.mark.slow
def test_interleaved_moe_equals_plain_1f1b(corpus_prefix, tmp_path):
    """Each model chunk backpropagates its own MoE layer's router losses: every layer gets the gradient it gets in
    plain 1F1B, so the weights are equal bit for bit. The step's reported loss is the float32 sum of the stages'
    parts, which here group the router losses by chunk instead of by stage: equal to float32 rounding."""
    runs = run_world(_pair, 2, tmp_path, str(tmp_path), corpus_prefix, 1, False, "none", {"model": MOE},
                     timeout_s=55)
    plain, interleaved = runs[0]
    assert interleaved["digest"] == plain["digest"]
    assert interleaved["val"] == plain["val"]  # evaluation adds no router losses
    assert interleaved["losses"] == pytest.approx(plain["losses"], rel=3e-7, abs=0)
