"""The expert-parallel dispatch (parallel.ep=2) computes what every rank holding every expert computes: the
outputs and the tokens' gradients bitwise, each expert's weight gradient as the sum of the ranks' (bitwise for two
ranks: one addition), with an expert that no rank routes a token to and a rank that sends another none."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatier.parallel.expert_dispatch import dispatch_to_experts, local_experts
from tests.distributed.world import run_world

pytestmark = pytest.mark.timeout(60)
EXPERTS, H, K, TOKENS = 4, 8, 2, 5


def _routing(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank 0 routes to experts 0-2, rank 1 to experts 0 and 1 only: expert 3 gets no token, and rank 1 sends
    rank 1 (experts 2, 3) nothing."""
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randn(TOKENS, H, generator=g, dtype=torch.float64).requires_grad_()
    choices = 3 if rank == 0 else 2
    ids = torch.stack([torch.randperm(choices, generator=g)[:K] for _ in range(TOKENS)])
    weights = torch.rand(TOKENS, K, generator=g, dtype=torch.float64).requires_grad_()
    return tokens, ids, weights


def _run(rank: int) -> dict:
    weights_of = torch.randn(EXPERTS, H, H, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    group = dist.new_group([0, 1])
    out = {}
    for ep, grp in ((1, None), (2, group)):
        held = {e: weights_of[e].clone().requires_grad_() for e in local_experts(EXPERTS, ep, rank if ep > 1 else 0)}
        tokens, ids, weights = _routing(rank)
        y = dispatch_to_experts(tokens, ids, weights, lambda e, x: x @ held[e].T, EXPERTS, grp)
        y.square().sum().backward()
        grads = {e: w.grad.clone() for e, w in held.items()}
        if ep == 1:  # every rank holds every expert: the sum over ranks is the ep=2 holder's gradient
            for g in grads.values():
                dist.all_reduce(g)
        out[ep] = {"y": y.detach(), "tokens": tokens.grad, "weights": weights.grad, "experts": grads}
    return out


def test_ep2_dispatch_equals_every_rank_holding_every_expert(tmp_path):
    for rank, res in enumerate(run_world(_run, 2, tmp_path, timeout_s=30)):
        one, two = res[1], res[2]
        for key in ("y", "tokens", "weights"):
            assert torch.equal(one[key], two[key]), (rank, key)
        assert sorted(two["experts"]) == list(local_experts(EXPERTS, 2, rank))
        for e, grad in two["experts"].items():
            assert torch.equal(grad, one["experts"][e]), (rank, e)
        if rank == 1:
            assert not two["experts"][3].any()  # no token: it took part, with a zero gradient
