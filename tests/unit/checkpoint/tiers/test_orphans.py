"""Node memory after a resharded restore: what ranks of an older layout or ring left behind.

A job that carried on with fewer ranks (or another ring) leaves own areas of ranks that no longer exist and
replica areas of owners no ring feeds any more. The node's lister reclaims them against the watermark (the new
layout's base committed everywhere); the job's own areas keep their own policy; a one-node job (no ring) still
lists and reads the replica area an earlier launch left, and never writes to it.
"""
from __future__ import annotations

import pytest

from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.tiers.base import TIER2
from megatier.checkpoint.tiers.local import LocalTier
from megatier.checkpoint.tiers.node_memory import NodeMemory
from megatier.checkpoint.tiers.peer import ReplicaArea
from tests.unit.checkpoint.tiers.test_node_memory import JOB, base_payload, diff_payload

pytestmark = pytest.mark.timeout(30)


def _held(memory: NodeMemory, owner: int, replica: bool = False) -> list[str]:
    return sorted(str(e.pid) for e in memory.entries(replica=replica, owner_rank=owner))


def _fill(memory: NodeMemory, owner: int, replica: bool = False) -> None:
    for payload in (base_payload(0, owner), diff_payload(1, 4, owner), base_payload(8, owner)):
        memory.save(payload, replica=replica)


def test_the_lister_reclaims_own_areas_of_ranks_beyond_the_world(tmp_path):
    memory = NodeMemory(str(tmp_path), JOB, "node0")
    for owner in (0, 1, 2, 3):  # an old world of 4 ranks on this node
        _fill(memory, owner)
    tier = LocalTier(memory, 0, world_size=2)  # rank 0 of the new world of 2, the node's lister
    tier.reclaim(None)  # no watermark yet: nothing of the old ranks goes
    assert _held(memory, 3) == ["base v0", "base v8", "diff v1-4"]
    tier.reclaim(12)
    assert _held(memory, 2) == _held(memory, 3) == []
    assert _held(memory, 1) == ["base v0", "base v8", "diff v1-4"]  # rank 1 exists: its own tier reclaims it


def test_a_rank_that_is_not_the_lister_leaves_other_areas_alone(tmp_path):
    memory = NodeMemory(str(tmp_path), JOB, "node0")
    _fill(memory, 3)
    LocalTier(memory, 1).reclaim(12)
    assert _held(memory, 3) == ["base v0", "base v8", "diff v1-4"]


def test_a_one_node_job_reads_the_replica_area_and_never_writes_it(tmp_path):
    memory = NodeMemory(str(tmp_path), JOB, "node0")
    _fill(memory, 2, replica=True)  # rank 2 of a lost node, replicated here by the old ring
    area = ReplicaArea(memory, lists=True)
    assert not area.saves and area.label == TIER2
    listing = area.list()
    assert sorted(str(c.pid) for c in listing.copies) == ["base v0", "base v8", "diff v1-4"]
    copy = next(c for c in listing.copies if c.pid == PayloadId.base(8))
    assert area.read(copy) == base_payload(8, 2)
    with pytest.raises(RuntimeError, match="read at restore only"):
        area.put(base_payload(9, 0))
    area.reclaim(8)  # the watermark: the job's own base v8 is committed everywhere
    assert _held(memory, 2, replica=True) == ["base v8"]
    area.reclaim(16)
    assert _held(memory, 2, replica=True) == []
