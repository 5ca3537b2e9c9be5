"""1F1B and forward-only pipeline schedules on 3 stages against the unsplit model.

Three ranks each hold one stage of a 4-layer GPT (uneven split 2/1/1) and also
the whole model. For several micro-batch counts (fewer than, equal to and more
than the stages, with uneven micro-batch sizes) the pipelined loss and every
parameter gradient must equal the no-pipeline schedule on the whole model.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatier.config import ModelConfig
from megatier.model.gpt import GPTStage, init_weights
from megatier.model.params import StageSpec, stage_layers
from megatier.parallel.p2p import PipelineComm
from megatier.parallel.schedules import forward_backward_1f1b, forward_backward_no_pipeline, forward_pipeline
from megatier.parallel.state import build_parallel_state
from tests.distributed.world import run_world

PP = 3
CFG = ModelConfig(num_layers=4, hidden_size=16, num_heads=2, max_position_embeddings=8)
VOCAB = 128
LOSS_SCALE = 4.0
MICROBATCH_SIZES = {1: [2], 3: [2, 1, 2], 5: [2, 3, 1, 2, 2]}

pytestmark = pytest.mark.timeout(120)


def _stage(ps, spec: StageSpec) -> GPTStage:
    model = GPTStage(CFG, VOCAB, spec, tp_group=ps.tp_group, dropout_generator=torch.Generator())
    init_weights(model, seed=3)
    return model


def _microbatches(sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(sum(sizes))
    return [(torch.randint(0, VOCAB, (b, 8), generator=gen), torch.randint(0, VOCAB, (b, 8), generator=gen))
            for b in sizes]


def _grads(model: GPTStage) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _pipeline_worker(rank: int) -> dict:
    ps = build_parallel_state(1, PP, 60.0, torch.device("cpu"))
    stage = _stage(ps, StageSpec(stage_layers(CFG.num_layers, PP, ps.pp_rank), ps.is_first_stage, ps.is_last_stage))
    whole = _stage(ps, StageSpec(range(CFG.num_layers), True, True))
    comm = PipelineComm(group=ps.pp_group, dtype=torch.float32, device=torch.device("cpu"))
    out = {"layers": list(stage.spec.layers)}
    for n, sizes in MICROBATCH_SIZES.items():
        mbs = _microbatches(sizes)
        stage.zero_grad(set_to_none=True)
        whole.zero_grad(set_to_none=True)
        loss = forward_backward_1f1b(stage, mbs, comm=comm, hidden_size=CFG.hidden_size, loss_scale=LOSS_SCALE)
        ref = forward_backward_no_pipeline(whole, mbs, loss_scale=LOSS_SCALE)
        # The tied embedding's two copies each hold half of its gradient until summed (as the Trainer does).
        for p in stage.shared_embedding_params():
            dist.all_reduce(p.grad, group=ps.embedding_group)
        ref_grads = _grads(whole)
        ref_grads["head_weight"] = ref_grads["word.weight"]
        out[n] = {
            "loss": (loss, ref if ps.is_last_stage else torch.zeros(())),
            "eval": (forward_pipeline(stage, mbs, comm=comm, hidden_size=CFG.hidden_size),
                     forward_backward_no_pipeline(whole, mbs, loss_scale=1.0, forward_only=True)
                     if ps.is_last_stage else torch.zeros(())),
            "grads": {name: (g, ref_grads[name]) for name, g in _grads(stage).items()},
        }
    return out


@pytest.fixture(scope="module")
def pipeline_results(tmp_path_factory) -> list[dict]:
    return run_world(_pipeline_worker, PP, tmp_path_factory.mktemp("pp"))


def test_uneven_split_puts_the_extra_layer_first(pipeline_results):
    assert [r["layers"] for r in pipeline_results] == [[0, 1], [2], [3]]


@pytest.mark.parametrize("n", sorted(MICROBATCH_SIZES))
def test_1f1b_loss_and_grads_match_no_pipeline(pipeline_results, n):
    for stage, res in enumerate(pipeline_results):
        loss, ref = res[n]["loss"]
        torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0.0)
        assert res[n]["grads"], stage
        for name, (g, ref_g) in res[n]["grads"].items():
            torch.testing.assert_close(g, ref_g, rtol=1e-5, atol=1e-7, msg=lambda m: f"stage {stage} {name}: {m}")
    assert float(pipeline_results[-1][n]["loss"][0]) > 0.0


@pytest.mark.parametrize("n", sorted(MICROBATCH_SIZES))
def test_forward_only_pipeline_matches_no_pipeline(pipeline_results, n):
    for res in pipeline_results:
        loss, ref = res[n]["eval"]
        torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0.0)
    assert float(pipeline_results[-1][n]["eval"][0]) > 0.0
