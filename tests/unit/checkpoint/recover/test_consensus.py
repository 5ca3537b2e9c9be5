"""Recovery consensus on hand-made inventories, the cascade order, and the listings it is built from."""
from __future__ import annotations

import logging

import pytest
import torch

from megatier.checkpoint.commit.committer import Committer
from megatier.checkpoint.commit.records import DoneMarker, marker_key, object_key
from megatier.checkpoint.format.payload import BaseState, Stamp, encode_base
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.recover.consensus import ConfigCheck, cascade, decide
from megatier.checkpoint.recover.inventory import RecoveryError
from megatier.checkpoint.recover.record import Sources, failure_class, recovery_record
from megatier.checkpoint.storage.directory import DirectoryStore
from megatier.checkpoint.tiers.base import TIER1, TIER2, TIER3, Copy
from megatier.checkpoint.tiers.local import LocalTier, list_area
from megatier.checkpoint.tiers.node_memory import NodeMemory
from megatier.checkpoint.tiers.remote import list_committed
from megatier.parallel.layout import Layout

pytestmark = pytest.mark.timeout(60)

JOB = "job"
DEG = (1, 1, 2)  # tp, pp, dp: a world of 2


def stamp(rank: int, pid: PayloadId, job: str = JOB, degrees: tuple = DEG) -> Stamp:
    tp, pp, dp = degrees
    layout = Layout(tp, pp, dp, rank % tp, rank // (tp * dp), (rank // tp) % dp)
    return Stamp(pid, 100, f"{rank:04x}{pid.first:06x}{pid.last:06x}", job, layout)


def B(v: int) -> PayloadId:
    return PayloadId.base(v)


def D(first: int, last: int) -> PayloadId:
    return PayloadId.diff(first, last)


def copies(ranks, pids, node="node0", replica=False, **kw) -> list[Copy]:
    tier = TIER3 if node is None else TIER2 if replica else TIER1
    return [Copy(stamp(r, p, **kw), tier, node) for r in ranks for p in pids]


def run(cs: list[Copy], world: int = 2, allow: bool = False, degrees: tuple = DEG, job: str = JOB):
    return decide(cs, job_id=job, degrees=degrees, traces=True, allow_fresh_start=allow,
                  looked="Tier-1 on nodes node0, node1 and Tier-3 at /remote")


DIFFS = [D(1, 2), D(3, 4), D(5, 6), D(7, 8), D(9, 10), D(11, 12)]


def test_nothing_anywhere_is_a_fresh_start():
    assert decide([], job_id=JOB, degrees=DEG, traces=False, allow_fresh_start=False,
                  looked="x") is None


def test_everything_in_own_tier1():
    c = run(copies([0, 1], [B(0), B(8), *DIFFS]))
    assert (c.version, c.end) == (8, 12)
    assert c.chains == {r: [B(8), D(9, 10), D(11, 12)] for r in (0, 1)}
    assert [x.node for x in c.copies[(1, D(9, 10))]] == ["node0"]


def test_newest_base_missing_for_one_rank_falls_back_to_an_older_common_base():
    cs = copies([0, 1], [B(0), *DIFFS]) + copies([0], [B(8)])
    c = run(cs)
    assert (c.version, c.end) == (0, 12)
    assert len(c.chains[1]) == 7


def test_no_base_for_a_rank_is_an_error_naming_it_and_where_it_looked(caplog):
    cs = copies([0], [B(0), B(8)]) + copies([1], DIFFS)
    with pytest.raises(RecoveryError) as e:
        run(cs)
    msg = str(e.value)
    assert "ranks [1] have no base" in msg and "v8" in msg and "node0, node1" in msg and "/remote" in msg
    assert "allow_fresh_start" in msg
    with caplog.at_level(logging.WARNING):
        assert run(cs, allow=True) is None
    assert "starting fresh" in caplog.text


def test_gap_in_one_ranks_chain_bounds_the_global_end():
    cs = copies([0], [B(0), *DIFFS]) + copies([1], [B(0), D(1, 2), D(3, 4), D(7, 8), D(9, 10)])
    c = run(cs)
    assert (c.version, c.end) == (0, 4)
    assert c.chains[0] == c.chains[1] == [B(0), D(1, 2), D(3, 4)]


def test_chain_must_start_right_after_the_base():
    c = run(copies([0, 1], [B(8), D(11, 12)]))
    assert (c.version, c.end) == (8, 8)
    assert c.chains == {0: [B(8)], 1: [B(8)]}


def test_replicas_only():
    cs = copies([0, 1], [B(0), *DIFFS[:3]], node="node1", replica=True)
    c = run(cs)
    assert (c.version, c.end) == (0, 6)
    assert all(x.replica and x.reach("node0") == TIER2 for x in c.copies[(0, B(0))])
    assert c.copies[(0, B(0))][0].reach("node1") == TIER1


def test_tier3_only():
    cs = copies([0, 1], [B(0), B(8), D(9, 10)], node=None)
    c = run(cs)
    assert (c.version, c.end) == (8, 10)
    assert c.copies[(1, B(8))][0].reach("node0") == TIER3


def test_mixed_tiers_combine_per_rank():
    # rank 0 keeps everything on node0; rank 1 lost node1: its base from Tier-3, diffs from a replica on node0.
    cs = (copies([0], [B(8), *DIFFS[4:]]) + copies([0, 1], [B(0), B(8), D(9, 10)], node=None)
          + copies([1], DIFFS, replica=True))
    c = run(cs)
    assert (c.version, c.end) == (8, 12)
    assert [x.reach("node1") for x in cascade(c.copies[(1, B(8))], "node1")] == [TIER3]
    assert [x.reach("node1") for x in cascade(c.copies[(1, D(9, 10))], "node1")] == [TIER2, TIER3]


def test_cascade_order_cheapest_first():
    cs = (copies([0], [B(0)], node=None) + copies([0], [B(0)], node="node2") + copies([0], [B(0)], node="node1",
          replica=True) + copies([0], [B(0)], node="node0", replica=True) + copies([0], [B(0)], node="node0"))
    order = [(x.node, x.replica) for x in cascade(cs, "node0")]
    assert order == [("node0", False), ("node0", True), ("node1", True), ("node2", False), (None, False)]


def test_another_layout_is_agreed_on_its_own_ranks_for_resharding():
    cs = copies([0, 1, 2, 3], [B(0), D(1, 2), D(3, 4)], degrees=(2, 1, 2))
    c = run(cs)
    assert (c.version, c.end, c.degrees) == (0, 4, (2, 1, 2)) and c.resharded(DEG)
    assert sorted(c.chains) == [0, 1, 2, 3]


def test_the_furthest_layout_wins_and_ours_on_a_tie():
    old = copies([0, 1, 2, 3], [B(0), D(1, 2), D(3, 4)], degrees=(2, 1, 2))
    ours = copies([0, 1], [B(4), D(5, 6)])
    c = run(old + ours)
    assert (c.version, c.end, c.degrees) == (4, 6, DEG) and not c.resharded(DEG)
    c = run(old + copies([0, 1], [B(4)]))
    assert (c.end, c.degrees) == (4, DEG)
    c = run(old + copies([0], [B(4), D(5, 6)]))  # our layout's rank 1 lost its base: the old layout stands
    assert (c.version, c.end, c.degrees) == (0, 4, (2, 1, 2))


def test_an_incomplete_other_layout_names_its_missing_ranks():
    cs = copies([0, 1, 2], [B(0)], degrees=(2, 1, 2))
    with pytest.raises(RecoveryError, match=r"ranks \[3\] have no base"):
        run(cs)


def test_other_job_is_refused_naming_both():
    cs = copies([0, 1], [B(0)], job="old-run")
    with pytest.raises(RecoveryError) as e:
        run(cs)
    assert "'old-run'" in str(e.value) and f"'{JOB}'" in str(e.value)


def test_foreign_copies_beside_usable_ones_are_ignored():
    cs = (copies([0, 1], [B(0), D(1, 2)]) + copies([0, 1], [B(8)], job="other")
          + copies([0, 1], [B(0)], degrees=(2, 1, 1)))  # an older layout's state, not reaching as far
    c = run(cs)
    assert (c.version, c.end, c.degrees) == (0, 2, DEG)
    assert len(c.ignored) == 2


def test_overlapping_chains_after_a_rebase():
    # A re-base at 5 (after a recovery) makes batches 6-7; an old 5-6 also exists for rank 0.
    cs = copies([0, 1], [B(0), B(5), D(1, 2), D(3, 4), D(6, 7)]) + copies([0], [D(5, 6)])
    c = run(cs)
    assert (c.version, c.end) == (5, 7)
    assert c.chains[0] == [B(5), D(6, 7)]


def _base_payload(rank: int, version: int, degrees=DEG):
    layout = stamp(rank, B(version), degrees=degrees).layout
    t = torch.arange(4, dtype=torch.float32) + rank
    return encode_base(BaseState(version, version, t, t, t, {}, None, {}), job_id=JOB, layout=layout)


def test_listings_feed_the_consensus(tmp_path):
    root = str(tmp_path / "t1")
    node0, node1 = NodeMemory(root, JOB, "node0"), NodeMemory(root, JOB, "node1")
    assert not LocalTier(node0, 0).list().traces
    for v in (0, 4):
        node0.save(_base_payload(0, v))
        node1.save(_base_payload(1, v))
        node1.save(_base_payload(0, v), replica=True)
    node0.write_progress(0, 5)
    node0.store.put("own/rank00000/base/v00000009.safetensors", b"partial")  # no stamp: incomplete
    store = DirectoryStore(str(tmp_path / "t3" / JOB), fsync=False)
    store.put(marker_key(B(4), 0), b"{}")  # an uncommitted leftover
    leftover_only = list_committed(store)
    assert leftover_only.traces and leftover_only.copies == []
    for r in (0, 1):
        p = _base_payload(r, 0)
        store.put(object_key(p.stamp), p.data)
        store.put(marker_key(B(0), r), DoneMarker(object_key(p.stamp), p.stamp, "inc").to_json())
    assert Committer(store, JOB).try_commit(B(0), 2) is not None
    own0 = LocalTier(node0, 0).list()
    assert own0.progress == {0: 5} and own0.incomplete == 1 and own0.traces
    own1, replicas1 = list_area(node1, TIER1, replica=False), list_area(node1, TIER2, replica=True)
    assert {(c.owner, c.replica) for c in own1.copies + replicas1.copies} == {(1, False), (0, True)}
    remote = list_committed(store)
    assert {c.pid for c in remote.copies} == {B(0)}
    cs = own0.copies + own1.copies + replicas1.copies + remote.copies
    assert len(cs) == 2 + 4 + 2
    c = decide(cs, job_id=JOB, degrees=DEG, traces=True, allow_fresh_start=False, looked="here")
    assert (c.version, c.end) == (4, 4)
    assert [(x.node, x.replica) for x in cascade(c.copies[(0, B(4))], "node1")] == [("node1", True),
                                                                                   ("node0", False)]


def test_failure_class_and_record():
    assert failure_class({TIER1}, True) == "software"
    assert failure_class({TIER1, TIER2}, True) == "node"
    assert failure_class({TIER3}, False) == "rack"
    assert failure_class({TIER1, TIER3}, True) == "mixed"
    c = run(copies([0, 1], [B(8), D(9, 10)]))
    served = Sources()
    for rank, pid, tier in [(0, B(8), TIER1), (1, B(8), TIER3), (0, D(9, 10), TIER1), (1, D(9, 10), TIER2)]:
        served.add(rank, pid.kind == "base", tier)
    assert served.of(1) == [TIER2, TIER3] and served.used() == {TIER1, TIER2, TIER3}
    rec = recovery_record(c, served, {TIER1: 13, TIER2: 3, TIER3: 12}, ["x"], times=[(1, 2, 3), (4, 0, 1)],
                          stale_removed=2, tier1_present=True, last_step=13, rank_nodes=["n0", "n1"])
    assert rec["rank_tiers"] == [[TIER1], [TIER2, TIER3]] and rec["rank_nodes"] == ["n0", "n1"]
    assert rec["source_tiers"] == {TIER1: 1, TIER2: 0, TIER3: 1} and rec["failure_class"] == "mixed"
    assert (rec["version"], rec["end"], rec["steps_lost"], rec["last_step"]) == (8, 10, 3, 13)
    assert (rec["t_consensus_s"], rec["t_rollback_s"], rec["t_replay_s"]) == (4, 2, 3)
    assert (rec["bytes_tier1"], rec["bytes_tier2"], rec["bytes_tier3"]) == (13, 3, 12)


def _fp_copies(ranks, pids, fingerprint: str) -> list[Copy]:
    out = []
    for r in ranks:
        for p in pids:
            s = stamp(r, p)
            out.append(Copy(Stamp(s.pid, s.size, s.xxh64, s.job_id, s.layout, fingerprint), TIER1, "node0"))
    return out


def test_another_config_is_refused_naming_the_keys_unless_allowed():
    old = {"optim.lr": "0.0006", "train.seed": "1234", "model.hidden_size": "64"}
    new = {"optim.lr": "0.001", "train.seed": "7", "model.hidden_size": "64"}
    cs = _fp_copies([0, 1], [B(0), D(1, 2)], "old")
    check = ConfigCheck("new", new, {"old": old, "new": new})
    with pytest.raises(RecoveryError) as e:
        decide(cs, job_id=JOB, degrees=DEG, traces=True, allow_fresh_start=True, looked="x",
               config=check)
    msg = str(e.value)
    assert "optim.lr: 0.0006 -> 0.001" in msg and "train.seed: 1234 -> 7" in msg
    assert "checkpoint.allow_changes=[optim.lr,train.seed]" in msg and "new checkpoint.job_id" in msg
    allowed = ConfigCheck("new", new, {"old": old}, ("optim.lr", "train.seed"))
    c = decide(cs, job_id=JOB, degrees=DEG, traces=True, allow_fresh_start=False, looked="x",
               config=allowed)
    assert (c.version, c.end) == (0, 2)
    partly = ConfigCheck("new", new, {"old": old}, ("optim.lr",))
    assert partly.refusal("old") == "another configuration (train.seed: 1234 -> 7)"


def test_an_unrecorded_config_is_refused_unless_any_change_is_allowed():
    cs = _fp_copies([0, 1], [B(0)], "lost")
    with pytest.raises(RecoveryError, match=r"no record .*allow_changes=\['\*'\]"):
        decide(cs, job_id=JOB, degrees=DEG, traces=True, allow_fresh_start=False, looked="x",
               config=ConfigCheck("new", {"a": "1"}))
    c = decide(cs, job_id=JOB, degrees=DEG, traces=True, allow_fresh_start=False, looked="x",
               config=ConfigCheck("new", {"a": "1"}, allow=("*",)))
    assert c.version == 0


def test_units_of_the_current_config_beside_older_ones_are_used():
    cs = _fp_copies([0, 1], [B(0), D(1, 2)], "old") + _fp_copies([0, 1], [B(2), D(3, 4)], "new")
    c = decide(cs, job_id=JOB, degrees=DEG, traces=True, allow_fresh_start=False, looked="x",
               config=ConfigCheck("new", {"a": "2"}, {"old": {"a": "1"}}))
    assert (c.version, c.end) == (2, 4) and len(c.ignored) == 4
