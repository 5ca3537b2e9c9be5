"""Tier-3 upload worker and two-phase commit, on a directory and on S3 (moto)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megatier.checkpoint.commit.committer import Committer
from megatier.checkpoint.commit.reader import RemoteReader
from megatier.checkpoint.commit.records import CommitError, commit_key, marker_key, object_key
from megatier.checkpoint.commit.uploader import Uploader, UploaderError
from megatier.checkpoint.format.payload import DiffStep, PayloadError
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.storage.directory import DirectoryStore
from megatier.checkpoint.storage.store import ObjectNotFound
from megatier.faults import CrashPoint
from tests.checkpoint_fakes import FAST, JOB, WORLD, FlakyStore, base, diff, layout

pytestmark = pytest.mark.timeout(60)

def test_commit_round_trip(remote_store, upload_all):
    b50, d = PayloadId.base(50), PayloadId.diff(46, 50)
    payloads = {r: [diff(46, 50, r), base(50, r)] for r in range(WORLD)}
    uploaders = upload_all(remote_store, payloads)
    for u in uploaders.values():
        assert u.wait(timeout=20)
        assert u.close() == []
    committer = Committer(remote_store, JOB)
    record = committer.try_commit(b50, WORLD)
    assert record is not None and record.degrees == (2, 1, 2) and record.world_size == WORLD
    assert [m.stamp for m in record.ranks] == [payloads[r][1].stamp for r in range(WORLD)]
    assert committer.try_commit(b50, WORLD) == record  # idempotent
    assert [r.pid for r in committer.commit_pending(WORLD)] == [d]
    reader = RemoteReader(remote_store, JOB)
    assert reader.committed_bases() == [50] and reader.committed_diffs() == [(46, 50)]
    for r in range(WORLD):
        assert reader.load(b50, r) == payloads[r][1]
        assert reader.load(d, r) == payloads[r][0]
    stored = json.loads(remote_store.get(commit_key(b50)))
    assert stored["layout"] == {"tp": 2, "pp": 1, "dp": 2} and stored["world_size"] == WORLD
    markers = [m for p in stored["parts"] for m in json.loads(remote_store.get(p["key"]))]
    assert [m["key"].rpartition("/")[2][:9] for m in markers] == [f"rank{r:05d}" for r in range(WORLD)]
    assert all(m["stamp"]["xxh64"] and m["stamp"]["size"] for m in markers)


def test_crash_between_objects_and_marker_leaves_version_uncommitted(remote_store, upload_all):
    def crash_rank2_at_100(point: str, version: int) -> None:
        if point == CrashPoint.T3_BEFORE_MARKER and version == 100:
            raise RuntimeError("simulated crash")

    payloads = {r: [base(50, r), base(100, r)] for r in range(WORLD)}
    uploaders = upload_all(remote_store, payloads, {2: {"fault_hook": crash_rank2_at_100}})
    for r, u in uploaders.items():
        if r == 2:
            with pytest.raises(UploaderError, match="rank 2 stopped.*simulated crash"):
                u.wait(timeout=20)
        else:
            assert u.wait(timeout=20)
    # Rank 2's object for v100 is there, its marker is not.
    listing = remote_store.list("base/v00000100/")
    assert object_key(payloads[2][1].stamp) in listing and marker_key(PayloadId.base(100), 2) not in listing
    committer = Committer(remote_store, JOB)
    assert [r.pid for r in committer.commit_pending(WORLD)] == [PayloadId.base(50)]
    assert committer.try_commit(PayloadId.base(100), WORLD) is None
    reader = RemoteReader(remote_store, JOB)
    assert reader.committed_bases() == [50]
    with pytest.raises(ObjectNotFound, match="base v100 is not committed"):
        reader.load(PayloadId.base(100), 0)


def test_crash_before_commit_then_a_new_coordinator_commits(remote_store, upload_all):
    def crash(point: str, version: int) -> None:
        if point == CrashPoint.T3_BEFORE_COMMIT:
            raise RuntimeError("coordinator died")

    for u in upload_all(remote_store, {r: [base(50, r)] for r in range(WORLD)}).values():
        assert u.wait(timeout=20)
    with pytest.raises(RuntimeError, match="coordinator died"):
        Committer(remote_store, JOB, fault_hook=crash).try_commit(PayloadId.base(50), WORLD)
    assert RemoteReader(remote_store, JOB).committed() == []
    assert Committer(remote_store, JOB).try_commit(PayloadId.base(50), WORLD) is not None


def test_remote_failing_its_first_writes_is_retried_and_commits(remote_store, upload_all):
    flaky = FlakyStore(remote_store, failures=7)
    uploaders = upload_all(flaky, {r: [base(50, r)] for r in range(WORLD)})
    for u in uploaders.values():
        assert u.wait(timeout=20)
    assert sum(u.status().failures for u in uploaders.values()) == 7
    assert any("injected failure" in (u.status().last_error or "") for u in uploaders.values())
    record = Committer(flaky, JOB).try_commit(PayloadId.base(50), WORLD)
    assert record is not None
    assert RemoteReader(remote_store, JOB).load(PayloadId.base(50), 3).stamp == record.ranks[3].stamp


def test_markers_of_two_incarnations_are_never_mixed(tmp_path, upload_all):
    store = DirectoryStore(str(tmp_path))
    pid = PayloadId.base(50)
    # Ranks 0-1 of a launch that died, ranks 2-3 of the relaunch (different bytes: a lossy replay).
    old = upload_all(store, {r: [base(50, r, fill=0.5)] for r in range(2)}, incarnation="old")
    new = upload_all(store, {r: [base(50, r, fill=0.7)] for r in range(2, WORLD)}, incarnation="new")
    for u in [*old.values(), *new.values()]:
        assert u.wait(timeout=20)
    assert Committer(store, JOB).try_commit(pid, WORLD) is None
    redo = upload_all(store, {r: [base(50, r, fill=0.7)] for r in range(2)}, incarnation="new")
    for u in redo.values():
        assert u.wait(timeout=20)
    record = Committer(store, JOB).try_commit(pid, WORLD)
    assert record is not None and record.incarnation == "new"
    assert RemoteReader(store, JOB).load(pid, 0).stamp == base(50, 0, fill=0.7).stamp


def test_marker_without_its_object_is_not_committed(tmp_path, upload_all):
    store = DirectoryStore(str(tmp_path))
    for u in upload_all(store, {r: [base(50, r)] for r in range(WORLD)}).values():
        assert u.wait(timeout=20)
    store.delete(object_key(base(50, 1).stamp))
    assert Committer(store, JOB).try_commit(PayloadId.base(50), WORLD) is None


def test_corrupt_committed_object_is_refused_by_the_reader(tmp_path, upload_all):
    store = DirectoryStore(str(tmp_path))
    for u in upload_all(store, {r: [base(50, r)] for r in range(WORLD)}).values():
        assert u.wait(timeout=20)
    assert Committer(store, JOB).try_commit(PayloadId.base(50), WORLD) is not None
    key = object_key(base(50, 1).stamp)
    data = bytearray(store.get(key))
    data[-1] ^= 0xFF
    store.put(key, bytes(data))
    with pytest.raises(PayloadError, match=f"{key}.*xxh64"):
        RemoteReader(store, JOB).load(PayloadId.base(50), 1)


def test_marker_of_another_job_is_a_commit_error(tmp_path, upload_all):
    store = DirectoryStore(str(tmp_path))
    for u in upload_all(store, {r: [base(50, r)] for r in range(WORLD)}).values():
        assert u.wait(timeout=20)
    with pytest.raises(CommitError, match="share checkpoint.job_id"):
        Committer(store, "another-job").try_commit(PayloadId.base(50), WORLD)


def test_units_of_an_earlier_layout_of_the_job_are_left_alone(tmp_path, upload_all):
    """After a resharded restore (world 4 -> 2), the old layout's uncommitted units are not this world's to
    commit, and are no error either: the new coordinator skips them."""
    store = DirectoryStore(str(tmp_path))
    for u in upload_all(store, {r: [base(50, r)] for r in range(WORLD)}).values():
        assert u.wait(timeout=20)
    assert Committer(store, JOB).try_commit(PayloadId.base(50), 2) is None
    assert Committer(store, JOB).commit_pending(2) == []
    assert Committer(store, JOB).try_commit(PayloadId.base(50), WORLD) is not None  # the old world's own


def test_a_concurrent_commit_wins(tmp_path, upload_all):
    store = DirectoryStore(str(tmp_path))
    pid = PayloadId.base(50)
    for u in upload_all(store, {r: [base(50, r)] for r in range(WORLD)}).values():
        assert u.wait(timeout=20)
    ours = Committer(store, JOB).try_commit(pid, WORLD)
    store.delete(commit_key(pid))
    theirs = dataclasses.replace(ours, incarnation="other-coordinator")

    class Racing(FlakyStore):
        """Another coordinator's commit lands between our existence check and our conditional create."""

        def put_if_absent(self, key, data):
            header, parts = theirs.objects()
            for part_key, part in parts.items():
                self.inner.put(part_key, part)
            self.inner.put_if_absent(key, header)
            return self.inner.put_if_absent(key, data)

    assert Committer(Racing(store, 0), JOB).try_commit(pid, WORLD) == theirs
    assert store.get(commit_key(pid)) == theirs.objects()[0]


def test_uploader_keeps_payloads_while_the_remote_is_down(tmp_path):
    down = FlakyStore(DirectoryStore(str(tmp_path)), failures=10**9)
    uploader = Uploader(down, JOB, 0, incarnation="launch0", backoff=FAST)
    payload = base(50, 0)
    uploader.submit(payload)
    assert not uploader.wait(timeout=0.2)
    status = uploader.status()
    assert status.pending == (PayloadId.base(50),) and status.pending_bytes == len(payload.data)
    assert status.failures > 0 and "injected failure" in status.last_error
    assert uploader.close(timeout=0.1) == [PayloadId.base(50)]
    with pytest.raises(UploaderError, match="closed"):
        uploader.submit(payload)
    other = Uploader(down, JOB, 0, incarnation="launch0", backoff=FAST)
    with pytest.raises(ValueError, match="rank 1"):
        other.submit(base(50, 1))
    assert other.close(timeout=1.0) == []


def test_corrupt_marker_and_commit_record_are_named(tmp_path, upload_all):
    store = DirectoryStore(str(tmp_path))
    pid = PayloadId.base(50)
    for u in upload_all(store, {r: [base(50, r)] for r in range(WORLD)}).values():
        assert u.wait(timeout=20)
    good_marker = store.get(marker_key(pid, 1))
    store.put(marker_key(pid, 1), b'{"key": ')
    with pytest.raises(CommitError, match=f"{marker_key(pid, 1)}.*not valid JSON.*delete it"):
        Committer(store, JOB).try_commit(pid, WORLD)
    store.put(marker_key(pid, 1), good_marker)
    assert Committer(store, JOB).try_commit(pid, WORLD) is not None
    store.put(commit_key(pid), store.get(commit_key(pid))[:-20])
    with pytest.raises(PayloadError, match=f"{commit_key(pid)}.*malformed commit record"):
        RemoteReader(store, JOB).committed()


def test_uploader_copies_mapped_payloads_beyond_its_cap_while_the_remote_is_down(tmp_path):
    from megatier.checkpoint.commit.uploader import MAPPED_QUEUE_CAP
    from megatier.checkpoint.format.payload import draft_diff_batch
    from megatier.checkpoint.tiers.node_memory import NodeMemory

    tier = NodeMemory(str(tmp_path / "t1"), JOB, "node0")
    down = FlakyStore(DirectoryStore(str(tmp_path / "t3")), failures=10**9)
    uploader = Uploader(down, JOB, 0, incarnation="launch0", backoff=FAST)
    n = MAPPED_QUEUE_CAP + 3
    for i in range(n):
        steps = [DiffStep(i + 1, 1e-3, i + 1, False, {"g": torch.full((3,), float(i))}, {})]
        payload = tier.save_draft(draft_diff_batch(steps, job_id=JOB, layout=layout(0)))
        assert payload.mapped
        uploader.submit(payload)
    queued = list(uploader._queue)
    assert len(queued) == n and sum(p.mapped for p in queued) == MAPPED_QUEUE_CAP
    assert [bytes(p.data) for p in queued[-3:]] == [tier.load(0, p.stamp.pid).data for p in queued[-3:]]
    assert uploader.close(timeout=0.1) == [p.stamp.pid for p in queued]
