"""Fast versus durable frequencies (checkpoint.remote.base_every = n): Tier-3 gets the anchor and every n-th
base after it, every diff batch, and a rack failure recovers bit-exactly to the newest committed batch through
the bases Tier-3 skipped; node memory keeps every base and reclamation leaves every recovery point whole.

The manager is driven in a world of one: Tier-1 is a real LocalTier on node memory in a temporary directory
(its reclaim floor is max(W, its keep_bases-th newest base)), Tier-2 and Tier-3 are in memory (``memory.py``);
Tier-3 commits a unit as it is put and reclaims as the coordinator does (``reclaim/policy.remote_reclaim_set``),
so the watermark is the newest base Tier-3 got.
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from megatier.checkpoint.format.chain import chain_end
from megatier.checkpoint.format.units import BASE, DIFF, PayloadId
from megatier.checkpoint.manager import CheckpointManager
from megatier.checkpoint.policy.cadence import uploads_base
from megatier.checkpoint.reclaim.policy import remote_reclaim_set
from megatier.checkpoint.tiers.base import JOB as JOB_SCOPE
from megatier.checkpoint.tiers.base import TIER2, TIER3
from megatier.checkpoint.tiers.durable import DurableCadence, save_thread_tiers
from megatier.checkpoint.tiers.local import LocalTier
from megatier.checkpoint.tiers.node_memory import NodeMemory
from tests.unit.checkpoint.memory import JOB, NODE0, MemoryTier, context, snapshot, step, tiny_shard

pytestmark = pytest.mark.timeout(120)
BATCH, INTERVAL = 5, 10
B, D = PayloadId.base, PayloadId.diff


class ReclaimingTier3(MemoryTier):
    """Tier-3 in memory: every unit committed once put; reclaims behind the watermark as the coordinator does."""

    def __init__(self, keep_bases: int = 2):
        super().__init__(TIER3, scope=JOB_SCOPE)
        self.keep_bases = keep_bases

    def reclaim(self, watermark: Optional[int]) -> None:
        super().reclaim(watermark)
        if watermark is not None:
            for pid in remote_reclaim_set({p: True for p in self.held()}, watermark, self.keep_bases):
                self.delete(pid)


def _tiers(root) -> list:
    return [LocalTier(NodeMemory(str(root), JOB, NODE0), 0), MemoryTier(TIER2, lockstep=True, takes_steps=True),
            ReclaimingTier3()]


def _node_memory(tier: LocalTier) -> list[PayloadId]:
    return sorted((e.pid for e in tier.memory.entries(replica=False, owner_rank=0)), key=lambda p: (p.last, p.kind))


def _manager(tiers, every: int):
    opt, shard = tiny_shard(iters=100)
    ctx = context(tiers, base_interval=INTERVAL, batch=BATCH)
    ctx.cfg.remote.base_every = every
    return opt, CheckpointManager(ctx, shard, inline=True)


def _run(tiers, last: int, every: int, check=None) -> dict:
    """Train steps 1..last; the state after each step. ``check(step, metrics)`` runs after each step."""
    opt, manager = _manager(tiers, every)
    manager.restore()
    snaps = {0: snapshot(opt)}
    for s in range(1, last + 1):
        step(opt, s)
        snaps[s] = snapshot(opt)
        metrics = manager.after_step(s)
        if check is not None:
            check(s, metrics)
    return snaps  # the failure: the manager is dropped without close()


def _same(opt, snap: dict) -> bool:
    return all(torch.equal(getattr(opt, n), snap[n]) for n in ("master", "exp_avg", "exp_avg_sq")) and \
        torch.equal(opt.param_flat, snap["params"]) and opt.adam_steps == snap["adam_steps"]


def _bases(pids) -> list[int]:
    return sorted(p.version for p in pids if p.kind == BASE)


def test_uploads_base_counts_from_the_anchor():
    assert [v for v in range(0, 70, 10) if uploads_base(v, 0, 10, 2)] == [0, 20, 40, 60]
    assert [v for v in range(0, 70, 10) if uploads_base(v, 0, 10, 3)] == [0, 30, 60]
    assert [v for v in range(27, 100, 10) if uploads_base(v, 27, 10, 3)] == [27, 57, 87]  # after a restore to 27
    assert all(uploads_base(v, 0, 10, 1) for v in range(0, 70, 10))
    assert not uploads_base(7, 17, 10, 1)  # older than the anchor: another launch's
    with pytest.raises(ValueError):
        uploads_base(10, 0, 10, 0)


def test_only_tier3_is_wrapped_and_only_when_n_exceeds_one(tmp_path):
    tiers = _tiers(tmp_path)
    assert save_thread_tiers(tiers, base_interval=10, base_every=1, anchor=lambda: 0) == tiers
    wrapped = save_thread_tiers(tiers, base_interval=10, base_every=2, anchor=lambda: 0)
    assert wrapped[:2] == tiers[:2] and isinstance(wrapped[2], DurableCadence) and wrapped[2].tier is tiers[2]


@pytest.mark.parametrize("every", [1, 2, 3])
def test_tier3_gets_every_nth_base_and_every_batch_while_node_memory_gets_every_base(every, tmp_path):
    tiers = _tiers(tmp_path)
    durable = every * INTERVAL
    seen = []

    def check(s, m):
        if s % BATCH:
            return
        t1, t3 = _node_memory(tiers[0]), tiers[2].held()
        # The watermark is Tier-3's newest base and moves in steps of n intervals; the rack point every batch.
        assert m["watermark"] == s // durable * durable and m["rpo_rack"] == s and m["rpo_software"] == s, (s, m)
        w = m["watermark"]
        # Tier-3 keeps its bases at or above W and keep_bases at or below, and every batch after the
        # committed base before W: the chain from W (and from the base before it) reaches the rack point.
        assert _bases(t3) == [v for v in (w - durable, w) if v >= 0], (s, t3)
        diffs = sorted((p for p in t3 if p.kind == DIFF), key=lambda p: p.first)
        assert diffs == [D(f, f + BATCH - 1) for f in range(max(w - durable, 0) + 1, s, BATCH)], (s, t3)
        assert chain_end({w}, diffs) == s
        # Node memory keeps its two newest bases and the chain after the older one (it never waits for W).
        newest = s // INTERVAL * INTERVAL
        assert _bases(t1) == [v for v in (newest - INTERVAL, newest) if v >= max(w, 0)], (s, t1)
        assert chain_end({newest}, [p for p in t1 if p.kind != BASE]) == s
        seen.append(s)

    _run(tiers, 6 * INTERVAL + 3, every, check)
    assert seen[-1] == 6 * INTERVAL
    t2_bases = [p.version for _, p in tiers[1].puts if p.kind == BASE]
    t3_bases = [p.version for _, p in tiers[2].puts if p.kind == BASE]
    assert t2_bases == list(range(0, 6 * INTERVAL + 1, INTERVAL))  # the ring peer too: every base
    assert t3_bases == list(range(0, 6 * INTERVAL + 1, durable))
    assert [p for _, p in tiers[2].puts if p.kind == DIFF] == [D(f, f + 4) for f in range(1, 6 * INTERVAL, BATCH)]


@pytest.mark.parametrize("every, crash, version", [(2, 58, 40), (3, 58, 30), (3, 33, 30), (2, 17, 0)])
def test_a_rack_failure_recovers_bit_exactly_through_the_bases_tier3_skipped(every, crash, version, tmp_path):
    """Tier-3 alone (the nodes' memory is gone) holds base ``version`` and the batches after it: recovery
    replays them through the skipped bases to the newest batch Tier-3 committed, crash // BATCH * BATCH."""
    tiers = _tiers(tmp_path)
    snaps = _run(tiers, crash, every)
    t3 = tiers[2]  # Tier-1 (node memory) and Tier-2 (the ring peer's) are lost with the rack
    end = crash // BATCH * BATCH
    opt, manager = _manager([t3], every)
    start, record = manager.restore()
    assert (start, record["version"], record["failure_class"]) == (end, version, "rack"), record
    assert _same(opt, snaps[end])
    # The relaunch anchors at E: its base goes to Tier-3 whatever n, and the count starts again from it.
    assert t3.puts[-1][1] == B(end)


def test_with_node_memory_the_software_point_uses_every_base(tmp_path):
    tiers = _tiers(tmp_path)
    snaps = _run(tiers, 58, 2)
    opt, manager = _manager([LocalTier(NodeMemory(str(tmp_path), JOB, NODE0), 0)] + tiers[1:], 2)
    start, record = manager.restore()
    assert (start, record["version"], record["failure_class"]) == (58, 50, "software"), record
    assert _same(opt, snaps[58])
