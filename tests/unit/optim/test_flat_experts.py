"""FlatLayout with routed experts: each rank's shard (segment table and size) is the same under every ep that
divides dp, though at ep > 1 the rank holds only its ep rank's experts; the shards tile both regions."""
from __future__ import annotations

import pytest

from megatier.optim.flat import FlatLayout, ParamSpec
from megatier.parallel.expert_dispatch import local_experts
from megatier.parallel.state import expert_coordinates

EXPERTS = 4


def _params(experts) -> list[ParamSpec]:
    """Two MoE layers (router, experts), an embedding and a norm, in a stage's module order; experts of 7 x 3 and
    3 x 5 elements, so nothing divides evenly by chance."""
    out = [ParamSpec("word.weight", (11, 3), 0, 1, (11, 3))]
    for layer in range(2):
        out.append(ParamSpec(f"layers.{layer}.moe.router.weight", (EXPERTS, 3), None, 1, (EXPERTS, 3)))
        for e in experts:
            out += [ParamSpec(f"layers.{layer}.moe.experts.{e}.gate_up.weight", (7, 3), 0, 2, (7, 3), "", e),
                    ParamSpec(f"layers.{layer}.moe.experts.{e}.proj.weight", (3, 5), 1, 1, (3, 5), "", e)]
    return out + [ParamSpec("final_norm.weight", (3,), None, 1, (3,))]


@pytest.mark.parametrize("dp,ep", [(2, 2), (4, 2), (4, 4)])
def test_a_ranks_shard_is_the_same_under_every_ep(dp, ep):
    whole = FlatLayout.from_params(_params(range(EXPERTS)), dp, tp_rank=0)
    for dp_rank in range(dp):
        ep_rank, _ = expert_coordinates(dp_rank, dp, ep)
        split = FlatLayout.from_params(_params(local_experts(EXPERTS, ep, ep_rank)), dp, tp_rank=0, ep=ep)
        assert split.shard_size == whole.shard_size
        assert split.shard_segments(dp_rank) == whole.shard_segments(dp_rank)


@pytest.mark.parametrize("dp,ep", [(1, 1), (2, 1), (4, 2)])
def test_shards_tile_the_dense_and_expert_regions(dp, ep):
    held: dict[tuple[str, int], int] = {}
    for dp_rank in range(dp):
        ep_rank, _ = expert_coordinates(dp_rank, dp, ep)
        layout = FlatLayout.from_params(_params(local_experts(EXPERTS, ep, ep_rank)), dp, tp_rank=0, ep=ep)
        segments = layout.shard_segments(dp_rank)
        assert sum(s.numel for s in segments) <= layout.shard_size
        for s in segments:
            for i in range(s.param_offset, s.param_offset + s.numel):
                held[(s.name, i)] = held.get((s.name, i), 0) + 1
    whole = _params(range(EXPERTS))
    assert held == {(p.name, i): 1 for p in whole for i in range(p.shape[0] * p.shape[1] if len(p.shape) == 2
                                                                  else p.shape[0])}
