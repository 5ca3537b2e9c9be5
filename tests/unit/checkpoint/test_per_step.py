"""Per-step durability (diff.per_step): a failure anywhere in a batch loses at most the step in flight
(software) or the steps in flight to the ring peer (node), and recovery replays the partial batch bit-exactly.

Each case trains a run, crashes it at a step position inside the open batch, restores into a fresh shard
and compares the state with the same run's snapshot at the recovered step (a run without the failure).
"""
from __future__ import annotations

import glob
import os
import time

import pytest
import torch

from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.manager import CheckpointManager
from megatier.checkpoint.tiers.base import JOB as JOB_SCOPE
from megatier.checkpoint.tiers.base import TIER1, TIER2, TIER3
from megatier.checkpoint.tiers.local import LocalTier
from megatier.checkpoint.tiers.node_memory import NodeMemory
from tests.unit.checkpoint.memory import JOB, NODE0, MemoryTier, context, snapshot, step, tiny_shard

pytestmark = pytest.mark.timeout(120)
BATCH, INTERVAL = 5, 10
B, D, S = PayloadId.base, PayloadId.diff, PayloadId.step


def _run(tiers, last: int) -> dict:
    """Train steps 1..last with a per-step checkpointer over ``tiers``; the state after every step."""
    opt, shard = tiny_shard()
    manager = CheckpointManager(context(tiers, base_interval=INTERVAL, batch=BATCH), shard, inline=True)
    manager.restore()
    snaps = {0: snapshot(opt)}
    for s in range(1, last + 1):
        step(opt, s)
        snaps[s] = snapshot(opt)
        manager.after_step(s)
    return snaps  # the crash: the manager is dropped without close()


def _restore(tiers) -> tuple[int, dict, object]:
    opt, shard = tiny_shard()
    start, record = CheckpointManager(context(tiers, base_interval=INTERVAL, batch=BATCH), shard,
                                      inline=True).restore()
    return start, record, opt


def _same(opt, snap: dict) -> bool:
    return all(torch.equal(getattr(opt, n), snap[n]) for n in ("master", "exp_avg", "exp_avg_sq")) and \
        torch.equal(opt.param_flat, snap["params"]) and opt.adam_steps == snap["adam_steps"]


def _tiers() -> list[MemoryTier]:
    return [MemoryTier(TIER1, takes_steps=True), MemoryTier(TIER2, lockstep=True, takes_steps=True),
            MemoryTier(TIER3, scope=JOB_SCOPE)]


@pytest.mark.parametrize("position", range(1, BATCH + 1))
@pytest.mark.parametrize("in_flight", [False, True])
def test_a_software_failure_anywhere_in_a_batch_loses_at_most_one_step(position, in_flight):
    tiers = _tiers()
    crash = INTERVAL + position  # the batch 11..15 is open up to its last step
    snaps = _run(tiers, crash)
    if in_flight:  # the save thread had not written the last step's record anywhere when the process died
        for tier in tiers:
            tier.delete(D(crash - BATCH + 1, crash) if position == BATCH else S(crash))
    assert [pid for _, pid in tiers[2].puts if pid.kind != "base"] == [D(1, 5), D(6, 10)] + (
        [D(11, 15)] if position == BATCH else [])  # Tier-3 never gets step units
    start, record, opt = _restore(tiers)
    assert crash - start == (1 if in_flight else 0), record
    assert record["version"] == INTERVAL and record["failure_class"] == "software"
    assert _same(opt, snaps[start])


@pytest.mark.parametrize("position", range(1, BATCH + 1))
def test_a_node_failure_anywhere_in_a_batch_loses_at_most_two_steps(position):
    tiers = _tiers()
    crash = INTERVAL + position
    snaps = _run(tiers, crash)
    tiers[0].units.clear()  # the node and its memory are gone; the ring peer's replicas remain
    peer = tiers[1]
    for tick, pid in peer.puts:  # the units handed over at the crash step were still in transfer
        if tick == crash - 1:
            peer.delete(pid)
    start, record, opt = _restore(tiers)
    assert crash - 2 <= start <= crash, record  # Tier-3 (in memory: at once) may hold a closed batch
    assert _same(opt, snaps[start])


def test_step_units_make_way_for_their_batch():
    tiers = _tiers()
    _run(tiers, 13)
    assert tiers[0].held() == [B(10), S(11), S(12), S(13)]  # batch 6..10 and base 0 reclaimed at the sync
    _run(t := _tiers(), 15)
    assert t[0].held() == [B(10), D(11, 15)]
    assert t[1].held() == [B(10), S(11), S(12), S(13), S(14)]  # the batch 11..15 goes over at step 16


def test_without_per_step_a_failure_loses_the_open_batch():
    tiers = _tiers()
    opt, shard = tiny_shard()
    ctx = context(tiers, base_interval=INTERVAL, batch=BATCH)
    ctx.cfg.diff.per_step = False
    manager = CheckpointManager(ctx, shard, inline=True)
    manager.restore()
    for s in range(1, 14):
        step(opt, s)
        manager.after_step(s)
    assert not [pid for _, pid in tiers[0].units if pid.kind == "step"]
    start, _, _ = _restore(tiers)
    assert start == 10


def test_a_torn_step_record_is_ignored_and_reported(tmp_path):
    memory = NodeMemory(str(tmp_path), JOB, NODE0)
    tiers = [LocalTier(memory, 0), MemoryTier(TIER3, scope=JOB_SCOPE)]
    snaps = _run(tiers, 14)
    data = glob.glob(f"{tmp_path}/{JOB}/{NODE0}/own/rank00000/step/v00000014.safetensors")
    assert len(data) == 1 and os.path.exists(data[0].replace(".safetensors", ".json"))
    os.remove(data[0].replace(".safetensors", ".json"))  # the crash came between the record and its stamp
    with open(data[0], "r+b") as f:
        f.truncate(os.path.getsize(data[0]) // 2)
    start, record, opt = _restore([LocalTier(memory, 0), tiers[1]])
    assert start == 13 and _same(opt, snaps[13])  # step 14 is not replayed
    assert any("step v14 of rank 0 is incomplete" in note for note in record["fallbacks"]), record["fallbacks"]
    assert not glob.glob(f"{tmp_path}/{JOB}/{NODE0}/own/rank00000/step/v00000014.*")  # swept at cleanup


class _SlowBatches(MemoryTier):
    """Tier-1 whose diff batches take ``delay_s`` to store (a save thread starved on a loaded machine)."""

    def __init__(self, delay_s: float):
        super().__init__(TIER1, takes_steps=True)
        self.delay_s = delay_s

    def put(self, payload) -> None:
        if payload.stamp.pid.kind == "diff":
            time.sleep(self.delay_s)
        super().put(payload)


def test_without_a_ring_peer_the_loop_waits_for_the_batch_its_previous_step_closed():
    """No lockstep tier hands the closed batch on, so the step after a batch end waits (in ckpt_stall_ms) for
    the save thread to store it: a crash then still loses at most the step in flight, however slow the thread."""
    tier1 = _SlowBatches(delay_s=0.5)
    opt, shard = tiny_shard()
    manager = CheckpointManager(context([tier1, MemoryTier(TIER3, scope=JOB_SCOPE)], base_interval=INTERVAL,
                                        batch=BATCH), shard)  # a real save thread
    manager.restore()
    snaps = {0: snapshot(opt)}
    for s in range(1, 7):
        step(opt, s)
        snaps[s] = snapshot(opt)
        metrics = manager.after_step(s)
    assert (0, D(1, 5)) in tier1.units and metrics["ckpt_handover_ms"] >= 100  # step 6 waited for batch 1-5
    start, _, restored = _restore([tier1])  # the crash right after step 6: its step unit is there too
    assert start == 6 and _same(restored, snaps[6])
    manager.close()
