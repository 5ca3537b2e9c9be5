"""restore() with in-memory tiers in a world of one: the cascade, fallbacks, cleanup and refusals."""
from __future__ import annotations

import dataclasses
import json

import pytest
import safetensors.torch
import torch

from megatier.checkpoint.format.payload import EncodedPayload, checksum, read_metadata
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.manager import CheckpointManager
from megatier.checkpoint.recover.inventory import RecoveryError
from megatier.checkpoint.recover.restore import restore
from megatier.checkpoint.tiers.base import JOB, TIER1, TIER3
from tests.unit.checkpoint.memory import MemoryTier, context, snapshot, step, tiny_shard

pytestmark = pytest.mark.timeout(60)
B, D = PayloadId.base, PayloadId.diff


def _saved(steps: int) -> tuple[list[MemoryTier], dict]:
    tiers = [MemoryTier(TIER1), MemoryTier(TIER3, scope=JOB)]
    opt, shard = tiny_shard()
    manager = CheckpointManager(context(tiers), shard, inline=True)
    manager.restore()
    snaps = {}
    for s in range(1, steps + 1):
        step(opt, s)
        snaps[s] = snapshot(opt)
        manager.after_step(s)
    return tiers, snaps


def _corrupt(tier: MemoryTier, pid: PayloadId) -> None:
    p = tier.units[(0, pid)]
    data = bytearray(p.data)
    data[len(data) // 2] ^= 0xFF
    tier.units[(0, pid)] = EncodedPayload(bytes(data), p.stamp)


def test_a_corrupt_tier1_copy_falls_through_to_tier3_and_is_reported():
    tiers, snaps = _saved(12)
    _corrupt(tiers[0], B(10))
    opt, shard = tiny_shard()
    result = restore(context(tiers), shard, allow_fresh_start=False)
    assert (result.version, result.end) == (10, 10)
    assert result.record["source_tiers"] == {"tier1": 0, "tier2": 0, "tier3": 1}
    assert any("base v10" in f and "xxh64" in f for f in result.record["fallbacks"])
    assert torch.equal(opt.master, snaps[10]["master"])


def test_units_beyond_the_recovery_point_are_discarded():
    tiers, snaps = _saved(25)
    t1, t3 = tiers
    for t in tiers:  # base 20 is lost everywhere and Tier-3 never got batch 16-20
        t.delete(B(20))
    t3.delete(D(16, 20))
    opt, shard = tiny_shard()
    result = restore(context(tiers), shard, allow_fresh_start=False)
    assert (result.version, result.end) == (10, 15)
    assert torch.equal(opt.master, snaps[15]["master"]) and opt.adam_steps == snaps[15]["adam_steps"]
    assert result.record["stale_units_removed"] == 2  # batch 21-25 in both tiers
    assert all(pid.last <= 15 for t in tiers for _, pid in t.units)


def test_nothing_anywhere_is_a_fresh_start_and_a_lost_base_is_refused():
    tiers = [MemoryTier(TIER1), MemoryTier(TIER3, scope=JOB)]
    assert restore(context(tiers), tiny_shard()[1], allow_fresh_start=False) is None
    tiers, _ = _saved(6)
    for t in tiers:
        t.delete(B(0))
    with pytest.raises(RecoveryError, match="no base version is available"):
        restore(context(tiers), tiny_shard()[1], allow_fresh_start=False)
    assert restore(context(tiers), tiny_shard()[1], allow_fresh_start=True) is None


def _poison(tier: MemoryTier, pid: PayloadId) -> None:
    """Plant a NaN into the base's master weights and stamp the result with its own valid checksum (the
    Megatron-LM 5281 case: a copy that loads cleanly and turns the loss NaN)."""
    p = tier.units[(0, pid)]
    tensors = safetensors.torch.load(p.data)
    tensors["master"][3] = float("nan")
    data = safetensors.torch.save(tensors, metadata={"megatier": json.dumps(read_metadata(p.data, "test"))})
    tier.units[(0, pid)] = EncodedPayload(data, dataclasses.replace(p.stamp, size=len(data), xxh64=checksum(data)))


def test_a_poisoned_base_with_a_valid_checksum_is_never_restored():
    tiers, snaps = _saved(12)
    _poison(tiers[0], B(10))  # in node memory only: Tier-3's copy serves
    opt, shard = tiny_shard()
    result = restore(context(tiers), shard, allow_fresh_start=False)
    assert (result.version, result.end) == (10, 10) and result.record["source_tiers"]["tier3"] == 1
    assert any("base v10" in f and "poisoned" in f for f in result.record["fallbacks"])
    assert torch.equal(opt.master, snaps[10]["master"])

    tiers, snaps = _saved(12)
    for tier in tiers:  # every copy poisoned: the point before it, rebuilt from the older base and its chain
        _poison(tier, B(10))
    opt, shard = tiny_shard()
    result = restore(context(tiers), shard, allow_fresh_start=False)
    assert result.version == 0 and result.end == 10
    assert torch.equal(opt.master, snaps[10]["master"]) and bool(torch.isfinite(opt.master).all())


class _CountingTier(MemoryTier):
    def __init__(self, label):
        super().__init__(label)
        self.reads = 0

    def read(self, copy):
        self.reads += 1
        return super().read(copy)


def test_a_rank_whose_memory_is_at_the_end_keeps_it_and_reads_nothing():
    """In-process recovery: a survivor at E keeps its state (no read, no replay); one step ahead, it rolls back."""
    tiers, snaps = _saved(15)
    counting = _CountingTier(TIER1)
    counting.units = tiers[0].units
    opt, shard = tiny_shard()
    for s in range(1, 16):  # the survivor's own training: its memory is at step 15
        step(opt, s)
    shard.live_version = 15
    result = restore(context([counting, tiers[1]]), shard, allow_fresh_start=False)
    assert result.end == 15 and result.record["ranks_in_place"] == [0] and counting.reads == 0
    assert result.record["rank_tiers"] == [] and result.record["bytes_tier1"] == 0
    assert torch.equal(opt.master, snaps[15]["master"])
    step(opt, 16)  # one step past the end: restored from the copies
    shard.live_version = 16
    result = restore(context([counting, tiers[1]]), shard, allow_fresh_start=False)
    assert result.record["ranks_in_place"] == [] and counting.reads > 0
    assert torch.equal(opt.master, snaps[15]["master"])
