"""The replica check's decision, and a withheld base kept from Tier-3 while every other unit goes there."""
from __future__ import annotations

import torch

from megatier.checkpoint.format.payload import BaseState, encode_base
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.policy.replicas import due, odd_replicas
from megatier.checkpoint.tiers.base import JOB as JOB_SCOPE
from megatier.checkpoint.tiers.base import TIER1, TIER3
from megatier.checkpoint.tiers.durable import DurableCadence, save_thread_tiers
from megatier.parallel.layout import Layout
from tests.unit.checkpoint.memory import MemoryTier


def test_the_odd_replicas_are_those_outside_the_majority_or_all_of_a_tie():
    assert odd_replicas([(0, 7), (1, 7), (2, 7)]) == []
    assert odd_replicas([(0, 7), (1, 7), (5, 9)]) == [5]
    assert odd_replicas([(4, 7), (2, 9)]) == [2, 4]  # two replicas that differ: either may be wrong
    assert odd_replicas([(0, 1), (1, 2), (2, 3), (3, 1)]) == [0, 1, 2, 3]  # no majority
    assert odd_replicas([(0, 1)]) == []
    assert [s for s in range(1, 21) if due(s, 5)] == [5, 10, 15, 20] and not any(due(s, 0) for s in range(9))


def _base(version: int):
    t = torch.zeros(4)
    return encode_base(BaseState(version, version, t, t, t, {}, None, {}), job_id="j", layout=Layout(1, 1, 1, 0, 0, 0))


def test_a_withheld_base_never_reaches_tier3():
    local, remote = MemoryTier(TIER1), MemoryTier(TIER3, scope=JOB_SCOPE)
    assert save_thread_tiers([local, remote], base_interval=10, base_every=1, anchor=lambda: 0) == [local, remote]
    tiers = save_thread_tiers([local, remote], base_interval=10, base_every=1, anchor=lambda: 0, withholds=True)
    assert tiers[0] is local and isinstance(tiers[1], DurableCadence)
    tiers[1].withhold(10)
    for version in (0, 10, 20):
        for tier in tiers:
            tier.put(_base(version))
    assert [p.version for p in local.held()] == [0, 10, 20]
    assert remote.held() == [PayloadId.base(0), PayloadId.base(20)]
