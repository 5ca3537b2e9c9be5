"""Route schedules on 4 stages against the unsplit model taking the same routes.

Four ranks each hold one stage of a 4-layer GPT and the whole model. The micro-batches of a step go the
standard route, all of them or (CheckFree+) the odd ones swapped: layers in the order 1, 0, 3, 2. The pipelined
loss and every parameter gradient must equal the unsplit model applying its layers in each micro-batch's order.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatier.model.params import StageSpec, stage_layers
from megatier.parallel.p2p import PipelineComm
from megatier.parallel.route_schedule import checkfree_plus_routes, forward_backward_routes, route
from megatier.parallel.state import build_parallel_state
from tests.distributed.parallel.test_pipeline import CFG, LOSS_SCALE, _grads, _microbatches, _stage
from tests.distributed.world import run_world

PP = 4
SIZES = [2, 1, 2, 3]

pytestmark = pytest.mark.timeout(120)


def test_routes():
    assert route(4) == [(0, ("embed", "layers")), (1, ("layers",)), (2, ("layers",)), (3, ("layers", "head"))]
    assert route(4, swapped=True) == [(0, ("embed",)), (1, ("layers",)), (0, ("layers",)), (3, ("layers",)),
                                      (2, ("layers",)), (3, ("head",))]
    assert route(5, swapped=True)[1:6] == [(1, ("layers",)), (0, ("layers",)), (2, ("layers",)), (4, ("layers",)),
                                           (3, ("layers",))]
    assert [len(r) for r in checkfree_plus_routes(4, 3)] == [4, 6, 4]
    with pytest.raises(ValueError, match="at least 4 pipeline stages"):
        route(3, swapped=True)


def _reference(whole, mbs, orders) -> torch.Tensor:
    """The unsplit model, each micro-batch through its layers in ``orders[i]``; returns the summed loss."""
    total = torch.zeros(())
    for (tokens, labels), order in zip(mbs, orders):
        x = whole.embed(tokens)
        for layer in order:
            x = whole.layers[str(layer)](x)
        loss = whole.head(x, labels).float().mean() / len(mbs)
        (loss * LOSS_SCALE).backward()
        total += loss.detach()
    return total


def _worker(rank: int) -> dict:
    ps = build_parallel_state(1, PP, 60.0, torch.device("cpu"))
    stage = _stage(ps, StageSpec(stage_layers(CFG.num_layers, PP, ps.pp_rank), ps.is_first_stage, ps.is_last_stage))
    whole = _stage(ps, StageSpec(range(CFG.num_layers), True, True))
    comm = PipelineComm(group=ps.pp_group, dtype=torch.float32, device=torch.device("cpu"))
    mbs = _microbatches(SIZES)
    out = {}
    for name, routes, orders in (
            ("standard", [route(PP)] * len(SIZES), [[0, 1, 2, 3]] * len(SIZES)),
            ("checkfree_plus", checkfree_plus_routes(PP, len(SIZES)), [[0, 1, 2, 3], [1, 0, 3, 2]] * 2)):
        stage.zero_grad(set_to_none=True)
        whole.zero_grad(set_to_none=True)
        loss = forward_backward_routes(stage, mbs, routes, comm=comm, hidden_size=CFG.hidden_size,
                                       loss_scale=LOSS_SCALE)
        ref = _reference(whole, mbs, orders)
        for p in stage.shared_embedding_params():
            dist.all_reduce(p.grad, group=ps.embedding_group)
        ref_grads = _grads(whole)
        ref_grads["head_weight"] = ref_grads["word.weight"]
        out[name] = {"loss": (loss, ref if ps.is_last_stage else torch.zeros(())),
                     "grads": {n: (g, ref_grads[n]) for n, g in _grads(stage).items()}}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_world(_worker, PP, tmp_path_factory.mktemp("routes"))


@pytest.mark.parametrize("order", ["standard", "checkfree_plus"])
def test_route_loss_and_grads_match_the_unsplit_model(results, order):
    for stage, res in enumerate(results):
        loss, ref = res[order]["loss"]
        torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0.0)
        for name, (g, ref_g) in res[order]["grads"].items():
            torch.testing.assert_close(g, ref_g, rtol=1e-5, atol=1e-7, msg=lambda m: f"stage {stage} {name}: {m}")
    assert float(results[-1][order]["loss"][0]) > 0.0
