"""The ZeRO-1 flat all-gather gives the same result through torch 2.13's name and through the older one that
torch 2.4-2.12 have (the fallback forced by removing the new names), in a real 2-rank gloo world."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatier.optim.collectives import all_gather_flat
from tests.distributed.world import run_world

pytestmark = pytest.mark.timeout(120)


def _both_ways(rank: int) -> dict:
    group = dist.new_group([0, 1])
    out = {}
    for way in ("new", "old"):
        if way == "old":  # what a torch before 2.13 offers
            if hasattr(dist, "all_gather_single"):
                delattr(dist, "all_gather_single")
            assert not hasattr(dist, "all_gather_single")
        shard = torch.arange(4, dtype=torch.float32) + 10 * rank
        gathered = torch.empty(8)
        all_gather_flat(gathered, shard, group)
        out[way] = gathered
    return out


def test_the_fallback_all_gather_equals_the_new_one(tmp_path):
    for result in run_world(_both_ways, 2, tmp_path):
        for gathered in result.values():
            assert torch.equal(gathered, torch.tensor([0., 1, 2, 3, 10, 11, 12, 13]))
