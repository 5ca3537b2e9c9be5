"""Reclamation: deletion sets never touch what a recovery point needs; deleting follows them exactly."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatier.checkpoint.commit.committer import Committer
from megatier.checkpoint.commit.coordinator import reclaim_remote
from megatier.checkpoint.commit.reader import RemoteReader
from megatier.checkpoint.commit.records import DoneMarker, commit_key, list_units, marker_key, object_key
from megatier.checkpoint.format.payload import BaseState, DiffStep, encode_base, encode_diff_batch
from megatier.checkpoint.format.units import BASE, DIFF, PayloadId
from megatier.checkpoint.policy.cadence import uploads_base
from megatier.checkpoint.reclaim.executor import delete_units
from megatier.checkpoint.reclaim.policy import (
    beyond_end,
    local_reclaim_set,
    node_memory_floor,
    remote_reclaim_set,
    retention_floor,
)
from megatier.checkpoint.storage.directory import DirectoryStore
from megatier.checkpoint.tiers.local import LocalTier
from megatier.checkpoint.tiers.node_memory import NodeMemory
from megatier.parallel.layout import Layout

pytestmark = pytest.mark.timeout(60)

JOB = "job1"
LAYOUT = Layout(1, 1, 1, 0, 0, 0)


def chain_end(anchor: int, diffs: set[PayloadId]) -> int:
    """Furthest step reachable from base ``anchor`` through contiguous diff batches."""
    starts = {d.first: d.last for d in diffs if d.kind == DIFF}
    end = anchor
    while end + 1 in starts:
        end = starts[end + 1]
    return end


@st.composite
def histories(draw):
    """Units of a run: bases every B steps, diff batches of N steps, each present/committed at random."""
    batch = draw(st.sampled_from([1, 2, 5]))
    interval = batch * draw(st.integers(1, 4))
    horizon = interval * draw(st.integers(1, 6)) + draw(st.integers(0, interval - 1))
    units = {}
    for v in range(interval, horizon + 1, interval):
        state = draw(st.sampled_from(["absent", "uncommitted", "committed"]))
        if state != "absent":
            units[PayloadId.base(v)] = state == "committed"
    for first in range(1, horizon + 1 - batch + 1, batch):
        state = draw(st.sampled_from(["absent", "uncommitted", "committed", "committed"]))
        if state != "absent":
            units[PayloadId.diff(first, first + batch - 1)] = state == "committed"
    return units


@settings(max_examples=300, deadline=None)
@given(histories(), st.data())
def test_local_reclaim_keeps_the_recovery_point_and_drops_the_rest(units, data):
    held = set(units)
    bases = sorted(p.version for p in held if p.kind == BASE)
    watermark = data.draw(st.sampled_from(bases)) if bases else None
    doomed = local_reclaim_set(held, watermark)
    assert doomed <= held
    if watermark is None:
        assert doomed == set()
        return
    kept = held - doomed
    assert PayloadId.base(watermark) in kept
    for p in held:
        obsolete = p.version < watermark if p.kind == BASE else p.last <= watermark
        assert (p in doomed) == obsolete, p
    assert chain_end(watermark, kept) == chain_end(watermark, held)
    for v in bases:
        if v >= watermark:
            assert chain_end(v, kept) == chain_end(v, held)


@settings(max_examples=300, deadline=None)
@given(histories(), st.integers(1, 3), st.data())
def test_remote_reclaim_never_deletes_what_recovery_needs(units, keep_bases, data):
    committed = {p for p, c in units.items() if c}
    committed_bases = sorted(p.version for p in committed if p.kind == BASE)
    watermark = data.draw(st.sampled_from(committed_bases)) if committed_bases else None
    doomed = remote_reclaim_set(units, watermark, keep_bases)
    assert doomed <= set(units)
    if watermark is None:
        assert doomed == set()
        return
    kept = committed - doomed
    # Nothing at or past the watermark goes; the newest keep_bases committed bases <= W stay.
    assert all(p.last <= watermark for p in doomed)
    must_keep = [b for b in committed_bases if b <= watermark][-keep_bases:]
    for v in must_keep + [b for b in committed_bases if b > watermark]:
        assert PayloadId.base(v) in kept
    # Every recovery point from a kept committed base reaches exactly as far as before.
    for v in committed_bases:
        if PayloadId.base(v) in kept and v >= watermark:
            assert chain_end(v, kept) == chain_end(v, committed), v
    # One more base interval of diffs: the committed base before W still replays up to W.
    older = [b for b in committed_bases if b < watermark]
    if older and PayloadId.base(older[-1]) in kept:
        assert chain_end(older[-1], kept) == chain_end(older[-1], committed)
    # And reclamation does reclaim: old bases beyond the keep window and diffs before that interval.
    for p in units:
        if p.kind == BASE and p.version < watermark and PayloadId.base(p.version) not in kept:
            assert p in doomed
        if p.kind == DIFF and older and p.last <= older[-1]:
            assert p in doomed


def test_remote_reclaim_refuses_an_uncommitted_watermark():
    units = {PayloadId.base(50): True, PayloadId.base(100): False}
    with pytest.raises(ValueError, match="watermark 100 is not a committed base"):
        remote_reclaim_set(units, 100, 2)
    assert remote_reclaim_set(units, None, 2) == set()


def _base(version: int):
    t = torch.full((4,), float(version))
    return encode_base(BaseState(version, version, t, t, t, {}, None, {}), job_id=JOB, layout=LAYOUT)


def _diff(first: int, last: int):
    steps = [DiffStep(s, 1e-3, s, False, {"g": torch.ones(2)}, {}) for s in range(first, last + 1)]
    return encode_diff_batch(steps, job_id=JOB, layout=LAYOUT)


def test_reclaim_local_deletes_below_the_watermark(tmp_path):
    memory = NodeMemory(str(tmp_path), JOB, "node0")
    for v in (50, 100):
        memory.save(_base(v))
        memory.save(_base(v), replica=True)
    for first in range(41, 111, 5):
        memory.save(_diff(first, first + 4))
    tier = LocalTier(memory, rank=0)
    held = [s.pid for s in memory.list()]
    assert local_reclaim_set(held, None) == set()
    tier.reclaim(100)
    assert [s.pid for s in memory.list()] == [PayloadId.base(100), PayloadId.diff(101, 105), PayloadId.diff(106, 110)]
    assert [s.pid for s in memory.list(replica=True)] == [PayloadId.base(50), PayloadId.base(100)]
    replicas = [s.pid for s in memory.list(replica=True)]
    gone = delete_units(local_reclaim_set(replicas, 100), lambda p: memory.delete(0, p, replica=True))
    assert gone == [PayloadId.base(50)]


def test_deletion_goes_oldest_first_and_hits_the_crash_point_after_each_unit():
    order, hits = [], []
    doomed = {PayloadId.diff(6, 10), PayloadId.base(10), PayloadId.base(0), PayloadId.diff(1, 5)}
    gone = delete_units(doomed, order.append, fault=lambda point, version: hits.append((str(point), version)))
    assert gone == order == [PayloadId.base(0), PayloadId.diff(1, 5), PayloadId.base(10), PayloadId.diff(6, 10)]
    assert hits == [("gc.mid_delete", 0), ("gc.mid_delete", 5), ("gc.mid_delete", 10), ("gc.mid_delete", 10)]


def test_beyond_end_is_everything_that_ends_after_the_recovery_point():
    held = [PayloadId.base(0), PayloadId.diff(1, 5), PayloadId.diff(6, 10), PayloadId.base(10), PayloadId.base(15)]
    assert beyond_end(held, 10) == {PayloadId.base(15)}
    assert beyond_end(held, 7) == {PayloadId.diff(6, 10), PayloadId.base(10), PayloadId.base(15)}


class RecordingStore(DirectoryStore):
    def __init__(self, root: str):
        super().__init__(root, fsync=False)
        self.deleted: list[str] = []

    def delete(self, key: str) -> None:
        self.deleted.append(key)
        super().delete(key)


def _upload_and_commit(store, payload, commit: bool = True) -> None:
    store.put(object_key(payload.stamp), payload.data)
    store.put(marker_key(payload.stamp.pid, 0), DoneMarker(object_key(payload.stamp), payload.stamp, "l0").to_json())
    if commit:
        assert Committer(store, JOB).try_commit(payload.stamp.pid, 1) is not None


def test_reclaim_remote_keeps_bases_and_one_more_interval_of_diffs(tmp_path):
    store = RecordingStore(str(tmp_path))
    for v in (50, 100, 150):
        _upload_and_commit(store, _base(v))
    for first in range(1, 160, 5):
        _upload_and_commit(store, _diff(first, first + 4))
    _upload_and_commit(store, _base(200), commit=False)  # in flight: newer than W, untouched
    reader = RemoteReader(store, JOB)
    assert reader.committed_bases() == [50, 100, 150]
    gone = reclaim_remote(store, 150, keep_bases=2)
    assert reader.committed_bases() == [100, 150]  # a reader never offers a reclaimed unit
    assert set(gone) == {PayloadId.base(50)} | {PayloadId.diff(f, f + 4) for f in range(1, 100, 5)}
    units = list_units(store)
    assert sorted(p.version for p in units if p.kind == BASE) == [100, 150, 200]
    assert min(p.first for p in units if p.kind == DIFF) == 101
    # A unit stops being a recovery source (its _COMMITTED goes) before any of its bytes go.
    for pid in gone:
        keys = [k for k in store.deleted if k.startswith(pid.dirname + "/")]
        assert keys[0] == commit_key(pid) and len(keys) == 4  # the record's header and part, marker, payload


# ---- checkpoint.remote.base_every = n: Tier-3 gets every n-th base, node memory every base, both every batch ----

def _cadence_units(every: int, interval: int, batch: int, end: int) -> tuple[set[PayloadId], set[PayloadId]]:
    """(node memory, Tier-3) of a run from anchor 0 at batch end ``end``, before any reclaim: node memory has
    every base, Tier-3 every n-th (``cadence.uploads_base``); both have every closed diff batch."""
    diffs = {PayloadId.diff(f, f + batch - 1) for f in range(1, end - batch + 2, batch)}
    node = {PayloadId.base(v) for v in range(0, end + 1, interval)} | diffs
    remote = {PayloadId.base(v) for v in range(0, end + 1, interval) if uploads_base(v, 0, interval, every)} | diffs
    return node, remote


@pytest.mark.parametrize("every, end, watermark, tier3_kept", [
    # Tier-3 bases 0, 20, 40, 60 (every second of a base every 10 steps); W is the newest committed one.
    (2, 55, 40, {20, 40}),
    (2, 60, 60, {40, 60}),
    (2, 65, 40, {20, 40, 60}),  # base 60 uploaded, not yet known to every rank: W is still 40
    # Tier-3 bases 0, 30, 60.
    (3, 55, 30, {0, 30}),
    (3, 85, 60, {30, 60}),
])
def test_base_every_tier3_keeps_its_newest_bases_and_every_batch_after_the_one_before_w(every, end, watermark,
                                                                                        tier3_kept):
    interval, batch = 10, 5
    _, remote = _cadence_units(every, interval, batch, end)
    kept = remote - remote_reclaim_set({p: True for p in remote}, watermark, keep_bases=2)
    assert {p.version for p in kept if p.kind == BASE} == tier3_kept
    floor = watermark - every * interval  # the committed base before W (none when negative)
    assert {p for p in kept if p.kind == DIFF} == {p for p in remote if p.kind == DIFF and p.last > floor}
    # The rack point (W and every batch after it, through the bases Tier-3 skipped) reaches the newest batch,
    # from W and from the kept base before it alike: it moves every batch, not every n bases.
    for base in tier3_kept:
        assert chain_end(base, kept) == end


@pytest.mark.parametrize("every, end, watermark, node_kept", [
    (2, 55, 40, {40, 50}),  # W lags: node memory's own floor (2nd newest base, 40) and W agree
    (3, 55, 30, {40, 50}),  # W = 30 lags two intervals: node memory reclaims past it, down to its 2nd newest base
    (3, 60, 60, {60}),  # a new Tier-3 base learned at once: node memory keeps only it
    (3, 25, 0, {10, 20}),
])
def test_base_every_node_memory_reclaims_to_max_of_w_and_its_own_floor(every, end, watermark, node_kept):
    """What Tier-1/Tier-2 may delete given W: everything below max(W, the 2nd newest base), never the newest
    base and its chain (the software and node recovery points); the rack point lives on Tier-3 alone."""
    interval, batch = 10, 5
    node, _ = _cadence_units(every, interval, batch, end)
    below = node_memory_floor(watermark, retention_floor(node, 2))
    kept = node - local_reclaim_set(node, below)
    assert {p.version for p in kept if p.kind == BASE} == node_kept
    assert {p for p in kept if p.kind == DIFF} == {p for p in node if p.kind == DIFF and p.last > min(node_kept)}
    newest = max(node_kept)
    assert chain_end(newest, kept) == end and chain_end(min(node_kept), kept) == end


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.sampled_from([1, 2, 5]), st.integers(1, 4), st.integers(1, 40), st.integers(1, 3),
       st.integers(1, 3), st.data())
def test_base_every_reclaim_keeps_every_recovery_point(every, batch, per_base, batches, keep_bases, lag, data):
    """For any n, interval, run length and watermark lag: after both reclaims, Tier-3 alone still reaches the
    newest batch from W, and node memory from its newest base."""
    interval = batch * per_base
    end = batch * batches
    node, remote = _cadence_units(every, interval, batch, end)
    tier3_bases = sorted(p.version for p in remote if p.kind == BASE)
    watermark = tier3_bases[max(0, len(tier3_bases) - lag)]  # W may lag the newest Tier-3 base
    kept3 = remote - remote_reclaim_set({p: True for p in remote}, watermark, keep_bases)
    assert chain_end(watermark, kept3) == end
    assert all(PayloadId.base(v) in kept3 for v in tier3_bases if v >= watermark)
    keep_node = data.draw(st.integers(1, 3))
    kept1 = node - local_reclaim_set(node, node_memory_floor(watermark, retention_floor(node, keep_node)))
    newest = max(p.version for p in node if p.kind == BASE)
    assert PayloadId.base(newest) in kept1 and chain_end(newest, kept1) == end
    assert len([p for p in kept1 if p.kind == BASE]) <= keep_node  # bounded whatever n and the lag of W
