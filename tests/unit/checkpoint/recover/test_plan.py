"""Rank 0's decision cut into per-rank plans, and a failed decision raised on every rank."""
from __future__ import annotations

import pytest

from megatier.checkpoint.comm import SoloComm
from megatier.checkpoint.recover.inventory import ConfigRefusal, RecoveryError
from megatier.checkpoint.recover.plan import RankPlan, Refusal, coordinated, cut
from tests.unit.checkpoint.recover.test_consensus import B, D, copies, run

pytestmark = pytest.mark.timeout(60)

DEG4 = (1, 1, 4)  # a world of 4, dp 4


def _held(ranks, node, replica=False):
    return copies(ranks, [B(0), B(4), D(5, 6), D(7, 8)], node=node, replica=replica, degrees=DEG4)


def _consensus():
    """Ranks 0-1 on node0, 2-3 on node1; each node holds the other's replicas; Tier-3 the bases."""
    held = (_held([0, 1], "node0") + _held([2, 3], "node1") + _held([0, 1], "node1", replica=True)
            + _held([2, 3], "node0", replica=True) + copies(range(4), [B(0), B(4)], node=None, degrees=DEG4))
    return run(held, degrees=DEG4)


def test_in_the_same_layout_each_rank_gets_only_its_own_chain_and_copies():
    consensus = _consensus()
    assert (consensus.version, consensus.end) == (4, 8)
    plans = cut(consensus, ["node0", "node0", "node1", "node1"], DEG4, RankPlan(None, last_step=8))
    for r, plan in enumerate(plans):
        assert plan.passes == [r] and plan.rounds == [3]  # base v4, then two batches: the same on every rank
        assert list(plan.consensus.chains) == [r] and plan.consensus.chains[r] == [B(4), D(5, 6), D(7, 8)]
        assert {owner for owner, _ in plan.consensus.copies} == {r}
        assert len(plan.consensus.copies[(r, B(4))]) == 3  # its node's, the ring peer's, Tier-3's
        assert (plan.consensus.version, plan.consensus.end, plan.last_step) == (4, 8, 8)
    assert consensus.chains.keys() == {0, 1, 2, 3}  # rank 0's own consensus is left whole


def test_resharding_hands_every_old_rank_to_exactly_one_rank_and_only_its_units():
    consensus = _consensus()
    plans = cut(consensus, ["node0", "node1"], (1, 1, 2), RankPlan(None))  # dp 4 -> 2: two old ranks each
    assert all(p.rounds == [3, 3] for p in plans)
    fetched = [old for p in plans for old in p.passes]
    assert sorted(fetched) == [0, 1, 2, 3]
    for plan in plans:
        assert set(plan.consensus.chains) == set(plan.passes)
        assert {owner for owner, _ in plan.consensus.copies} == set(plan.passes)
    assert set(plans[0].passes) == {0, 1} and set(plans[1].passes) == {2, 3}  # each where its old bases are


def test_a_fresh_start_is_the_same_plan_for_every_rank():
    shared = RankPlan(None, history=[{"n": 1}])
    assert cut(None, ["node0", "node1"], (1, 1, 2), shared) == [shared, shared]


class _Rank1(SoloComm):
    """Rank 1 of two: what rank 0 scattered arrives here."""

    rank, world_size = 1, 2

    def __init__(self, item):
        self.item = item

    def scatter(self, items, what=""):
        assert items is None  # a rank other than 0 sends nothing
        return self.item


def test_a_decision_that_fails_on_rank_0_is_raised_on_every_rank():
    def refuse():
        raise ConfigRefusal("refusing to recover: another job")

    with pytest.raises(ConfigRefusal, match="another job"):
        coordinated(SoloComm(), refuse, "the recovery plan")
    with pytest.raises(ConfigRefusal, match="another job"):
        coordinated(_Rank1(Refusal(ConfigRefusal, "refusing to recover: another job")), None, "the recovery plan")

    def broken():
        raise KeyError("node7")

    scattered = []

    class _Rank0(SoloComm):
        world_size = 2

        def scatter(self, items, what=""):
            scattered.extend(items)
            return items[0]

    with pytest.raises(KeyError):  # rank 0 raises its own error; the others learn what it was
        coordinated(_Rank0(), broken, "the recovery plan")
    assert len(scattered) == 2 and scattered[1].error is RecoveryError
    assert "rank 0 failed deciding the recovery plan: KeyError" in scattered[1].message
    plan = RankPlan(None)
    assert coordinated(_Rank1(plan), None, "the recovery plan") is plan
