"""Tier-3 as a tier: a corrupt committed unit is quarantined (never offered again) and a good copy recommitted."""
from __future__ import annotations

import time

import pytest
import torch

from megatier.checkpoint.commit.coordinator import reclaim_remote
from megatier.checkpoint.commit.lease import LeaseHeld, OwnerLease
from megatier.checkpoint.commit.reader import RemoteReader
from megatier.checkpoint.commit.records import QUARANTINE, SUPERSEDED, list_units, set_aside
from megatier.checkpoint.format.payload import BaseState, DiffStep, encode_base, encode_diff_batch
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.offline.listing import inspect_quarantine
from megatier.checkpoint.storage.directory import DirectoryStore
from megatier.checkpoint.tiers.remote import RemoteTier, list_committed
from megatier.parallel.layout import Layout
from tests.checkpoint_fakes import Outage

pytestmark = pytest.mark.timeout(60)
B10 = PayloadId.base(10)


def _wait_committed(store, pid, timeout=20.0) -> None:
    deadline = time.monotonic() + timeout
    while not (pid in list_units(store) and list_units(store)[pid].committed):
        assert time.monotonic() < deadline, f"{pid} was not committed in time"
        time.sleep(0.05)


def _base(version: int):
    t = torch.arange(8, dtype=torch.float32)
    return encode_base(BaseState(version, version, t, t * 2, t * 3, {}, None, {}), job_id="job1",
                       layout=Layout(1, 1, 1, 0, 0, 0))


def test_quarantine_then_repair_from_a_surviving_copy(tmp_path):
    store = DirectoryStore(str(tmp_path / "t3"), fsync=False)
    payload = _base(10)
    tier = RemoteTier(store, job_id="job1", rank=0, world_size=1, incarnation="a", keep_bases=2)
    tier.start()
    tier.put(payload)
    _wait_committed(store, B10)
    obj = next(k for k in store.list("base/") if k.endswith(".safetensors"))
    data = bytearray(store.get(obj))
    data[len(data) // 2] ^= 0xFF
    store.put(obj, bytes(data))
    dest = tier.quarantine(B10, "base v10 failed its checksum at restore (rank 0)")
    assert dest is not None and dest.startswith(QUARANTINE)
    assert B10 not in list_units(store) and list_committed(store).copies == []
    rows = inspect_quarantine(store)
    assert len(rows) == 1 and "quarantined" in rows[0].status and "rank 0" in rows[0].status
    tier.repair(payload)  # the rank's Tier-1 copy survived
    _wait_committed(store, B10)
    assert RemoteReader(store, payload.stamp.job_id).load(B10, 0).data == payload.data
    tier.drain(11, 5.0)
    tier.close(5.0)


def _diff(first: int, last: int):
    steps = [DiffStep(s, 1e-3, s, False, {"g": torch.ones(3)}, {}) for s in range(first, last + 1)]
    return encode_diff_batch(steps, job_id="job1", layout=Layout(1, 1, 1, 0, 0, 0))


def test_committed_units_beyond_the_recovery_point_are_set_aside_not_kept(tmp_path):
    """A later launch that resumes at E retires an earlier incarnation's unreachable future: its commit no
    longer blocks the new run's unit of the same steps, and no chain can mix the two."""
    store = DirectoryStore(str(tmp_path / "t3"), fsync=False)
    tier = RemoteTier(store, job_id="job1", rank=0, world_size=1, incarnation="a", keep_bases=2)
    tier.start()
    for payload in (_base(0), _diff(1, 5), _diff(11, 15)):  # 6-10 never made it: 11-15 is unreachable
        tier.put(payload)
    _wait_committed(store, PayloadId.diff(11, 15))
    tier.drain(16, 5.0)
    tier.close(5.0)
    assert tier.discard_after(5) == ["Tier-3 diff v11-15 (superseded)"]
    assert PayloadId.diff(11, 15) not in list_units(store)
    assert [r.status.split(":")[0] for r in inspect_quarantine(store)][0].startswith("superseded")


def test_set_aside_units_are_reclaimed_once_the_watermark_passes_them(tmp_path):
    store = DirectoryStore(str(tmp_path / "t3"), fsync=False)
    tier = RemoteTier(store, job_id="job1", rank=0, world_size=1, incarnation="a", keep_bases=2)
    tier.start()
    for payload in (_base(0), _diff(11, 15), _base(20), _diff(31, 35)):
        tier.put(payload)
    for pid in (PayloadId.diff(11, 15), PayloadId.base(20), PayloadId.diff(31, 35)):
        _wait_committed(store, pid)
    tier.drain(36, 5.0)
    tier.close(5.0)
    units = list_units(store)
    for pid in (PayloadId.diff(11, 15), PayloadId.diff(31, 35)):
        set_aside(store, pid, list(units[pid].objects), "test", "t0", area=SUPERSEDED)
    reclaim_remote(store, 20, keep_bases=2)
    left = {k.split("/")[2] for k in store.list(SUPERSEDED)}
    assert left == {"v00000031-00000035"}, left  # 11-15 is behind the watermark, 31-35 is not


def test_an_offline_start_stops_when_another_live_run_holds_the_lease_once_tier3_answers(tmp_path):
    """A launch that started without Tier-3 writes nothing there until it holds the job's lease; when Tier-3
    answers and another live run holds the lease, the launch stops (at its next watermark sync) instead."""
    inner = DirectoryStore(str(tmp_path / "t3"), fsync=False)
    other = OwnerLease(inner, "other", lease_s=2.0)
    other.acquire()  # a live writer of the job, renewing its lease
    store = Outage(inner)
    store.down = True
    tier = RemoteTier(store, job_id="job1", rank=0, world_size=1, incarnation="mine", keep_bases=2,
                      lease=OwnerLease(store, "mine", 2.0), offline="unreachable at start-up", reconnect_s=0.05)
    assert tier.list().traces and not tier.holds_job()  # not consulted, and not empty: a restore never starts fresh
    tier.put(_base(10))
    tier.start()
    store.down = False
    deadline = time.monotonic() + 20
    while tier.lease.lost is None:
        assert time.monotonic() < deadline, "the lease conflict was not found"
        time.sleep(0.05)
    with pytest.raises(LeaseHeld, match="in use by a live run"):
        tier.point()
    assert not list_units(inner)  # the queued base never went out
    tier.drain(1, 1.0)
    tier.close(1.0)
    other.release()


def test_the_restore_history_is_kept_on_tier3_and_listed_with_its_units(tmp_path):
    store = DirectoryStore(str(tmp_path / "t3"), fsync=False)
    tier = RemoteTier(store, job_id="job1", rank=0, world_size=1, incarnation="a", keep_bases=2)
    tier.start()
    history = [{"n": 1, "version": 10, "end": 12, "mark": 12, "level": 0, "reached": None, "clean": False}]
    tier.record_restores(history)
    assert list_committed(store).restores == history
    store.put("_restores.json", b"{not json")  # an unreadable history is no history, never a refusal
    assert list_committed(store).restores == []
    tier.drain(1, 5.0)
    tier.close(5.0)
