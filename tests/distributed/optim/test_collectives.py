"""The ZeRO-1 flat collectives give the same result through torch 2.13's names and through the older ones that
torch 2.4-2.12 have (the fallback forced by removing the new names), in a real 2-rank gloo world."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatier.optim.collectives import all_gather_flat, reduce_scatter_flat
from tests.distributed.world import run_world

pytestmark = pytest.mark.timeout(120)


def _both_ways(rank: int) -> dict:
    group = dist.new_group([0, 1])
    out = {}
    for way in ("new", "old"):
        if way == "old":  # what a torch before 2.13 offers
            for name in ("all_gather_single", "reduce_scatter_single"):
                if hasattr(dist, name):
                    delattr(dist, name)
            assert not hasattr(dist, "all_gather_single")
        shard = torch.arange(4, dtype=torch.float32) + 10 * rank
        gathered = torch.empty(8)
        all_gather_flat(gathered, shard, group)
        full = torch.arange(8, dtype=torch.float32) * (rank + 1)
        mine = torch.empty(4)
        reduce_scatter_flat(mine, full, group)
        out[way] = (gathered, mine)
    return out


def test_the_fallback_collectives_equal_the_new_ones(tmp_path):
    for rank, result in enumerate(run_world(_both_ways, 2, tmp_path)):
        for gathered, mine in result.values():
            assert torch.equal(gathered, torch.tensor([0., 1, 2, 3, 10, 11, 12, 13]))
            assert torch.equal(mine, (torch.arange(8, dtype=torch.float32) * 3)[4 * rank:4 * rank + 4])
