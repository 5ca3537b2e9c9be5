"""Tier-1 areas: atomic saves, crash leftovers never visible, verified loads, chunked replicas."""
from __future__ import annotations

import os

import pytest
import torch

from megatier.checkpoint.format.payload import (
    BaseState,
    DiffStep,
    PayloadError,
    decode_base,
    encode_base,
    encode_diff_batch,
)
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.storage.store import ObjectNotFound
from megatier.checkpoint.tiers.node_memory import NodeMemory
from megatier.faults import CrashPoint
from megatier.parallel.layout import Layout

pytestmark = pytest.mark.timeout(30)

JOB = "job1"


def layout(rank: int) -> Layout:
    return Layout(tp=1, pp=1, dp=4, tp_rank=0, pp_rank=0, dp_rank=rank)


def base_payload(version: int, rank: int = 0, fill: float = 1.0):
    n = 16
    state = BaseState(version, version, torch.full((n,), fill), torch.zeros(n), torch.ones(n), {}, None,
                      {"consumed_samples": version})
    return encode_base(state, job_id=JOB, layout=layout(rank))


def diff_payload(first: int, last: int, rank: int = 0):
    steps = [DiffStep(s, 1e-3, s, False, {"g": torch.full((4,), float(s))}, {}) for s in range(first, last + 1)]
    return encode_diff_batch(steps, job_id=JOB, layout=layout(rank))


class Crash(Exception):
    pass


def crash_at(point: str):
    def hook(name: str, version: int) -> None:
        if name == point:
            raise Crash(f"{name}@{version}")
    return hook


def test_save_list_load_round_trip(tmp_path):
    tier = NodeMemory(str(tmp_path), JOB, "node0")
    b, d = base_payload(50, rank=1), diff_payload(46, 50, rank=1)
    tier.save(b)
    tier.save(d)
    tier.save(base_payload(50, rank=0), replica=True)
    assert tier.list() == [b.stamp, d.stamp]
    assert [s.rank for s in tier.list(replica=True)] == [0]
    loaded = tier.load(1, PayloadId.base(50))
    assert loaded == b
    assert decode_base(loaded, job_id=JOB, layout=layout(1), source="t").data_position == {"consumed_samples": 50}
    assert tier.bytes_held() >= len(b.data) + len(d.data)
    assert NodeMemory.nodes(str(tmp_path), JOB) == ["node0"]
    assert (tmp_path / JOB / "node0" / "own" / "rank00001" / "base" / "v00000050.safetensors").is_file()


def test_crash_mid_write_leaves_no_visible_payload_and_sweep_cleans_up(tmp_path):
    tier = NodeMemory(str(tmp_path), JOB, "node0", fault_hook=crash_at(CrashPoint.T1_MID_WRITE))
    with pytest.raises(Crash):
        tier.save(base_payload(50))
    assert tier.list() == []
    with pytest.raises(ObjectNotFound, match="no complete payload"):
        tier.load(0, PayloadId.base(50))
    assert [e.complete for e in tier.entries()] == [False]
    assert tier.sweep_incomplete(0) == [PayloadId.base(50)]
    assert tier.entries() == [] and tier.bytes_held() == 0


def test_resave_after_crash_never_shows_old_stamp_with_new_bytes(tmp_path):
    good = NodeMemory(str(tmp_path), JOB, "node0")
    good.save(base_payload(50, fill=1.0))
    crashing = NodeMemory(str(tmp_path), JOB, "node0", fault_hook=crash_at(CrashPoint.T1_MID_WRITE))
    with pytest.raises(Crash):
        crashing.save(base_payload(50, fill=2.0))
    # The old stamp was removed before the new bytes landed: the unit is incomplete, not corrupt.
    assert good.list() == []
    newer = base_payload(50, fill=3.0)
    good.save(newer)
    assert good.load(0, PayloadId.base(50)) == newer


def test_corrupt_file_is_reported_with_its_path(tmp_path):
    tier = NodeMemory(str(tmp_path), JOB, "node0")
    tier.save(diff_payload(46, 50))
    path = tmp_path / JOB / "node0" / "own" / "rank00000" / "diff" / "v00000046-00000050.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(PayloadError) as err:
        tier.load(0, PayloadId.diff(46, 50))
    assert str(path) in str(err.value) and "xxh64" in str(err.value)


def test_replica_arrives_in_chunks_and_is_verified(tmp_path):
    tier = NodeMemory(str(tmp_path), JOB, "node1")
    payload = base_payload(100, rank=2)
    writer = tier.begin_replica(payload.stamp)
    for i in range(0, len(payload.data), 97):
        writer.append(payload.data[i:i + 97])
        assert tier.list(replica=True) == []  # nothing visible before finish
    writer.finish()
    assert tier.load(2, PayloadId.base(100), replica=True) == payload


def test_replica_with_bad_bytes_is_discarded(tmp_path):
    tier = NodeMemory(str(tmp_path), JOB, "node1")
    payload = base_payload(100, rank=2)
    writer = tier.begin_replica(payload.stamp)
    writer.append(payload.data[:-1] + bytes([payload.data[-1] ^ 1]))
    with pytest.raises(PayloadError, match="replica was discarded"):
        writer.finish()
    writer = tier.begin_replica(payload.stamp)
    with pytest.raises(PayloadError, match="more than the announced"):
        writer.append(payload.data + b"x")
    assert tier.entries(replica=True) == []
    assert not [f for _, _, files in os.walk(tmp_path) for f in files]


def test_delete_removes_stamp_and_data(tmp_path):
    tier = NodeMemory(str(tmp_path), JOB, "node0")
    tier.save(base_payload(50))
    tier.delete(0, PayloadId.base(50))
    tier.delete(0, PayloadId.base(50))
    assert tier.entries() == []


def test_bad_node_or_job_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match="node name"):
        NodeMemory(str(tmp_path), JOB, "../escape")
    with pytest.raises(ValueError, match="checkpoint.job_id"):
        NodeMemory(str(tmp_path), "a/b", "node0")


def test_save_draft_writes_once_into_tier1_and_hands_out_that_file(tmp_path):
    from megatier.checkpoint.format.payload import draft_base
    from megatier.checkpoint.storage.directory import DirectoryStore

    n = 1000
    state = BaseState(50, 50, torch.randn(n), torch.randn(n), torch.rand(n), {}, None, {"consumed_samples": 50})
    tier = NodeMemory(str(tmp_path), JOB, "node0")
    payload = tier.save_draft(draft_base(state, job_id=JOB, layout=layout(1)))
    # The same bytes as serializing to memory, stamped and complete on Tier-1, mapped from its file; the stamp,
    # hashed from the pieces as they were written, is the one of the joined bytes.
    joined = encode_base(state, job_id=JOB, layout=layout(1))
    assert bytes(payload.data) == joined.data and payload.stamp == joined.stamp
    assert tier.list() == [payload.stamp]
    assert tier.load(1, PayloadId.base(50)).data == bytes(payload.data)
    assert payload.source is not None and os.fstat(payload.source.fileno()).st_size == payload.stamp.size
    # A file-system Tier-3 copies from the open Tier-1 file, even after Tier-1 reclaimed it.
    tier.delete(1, PayloadId.base(50))
    remote = DirectoryStore(str(tmp_path / "t3"))
    remote.put_from("obj", payload.data, payload.source)
    assert remote.get("obj") == bytes(payload.data)
    decoded = decode_base(payload, job_id=JOB, layout=layout(1), source="mapped")
    assert torch.equal(decoded.master, state.master)


def test_save_draft_crash_before_stamp_leaves_nothing_visible(tmp_path):
    from megatier.checkpoint.format.payload import draft_diff_batch

    steps = [DiffStep(s, 1e-3, s, False, {"g": torch.full((4,), float(s))}, {}) for s in range(1, 6)]
    tier = NodeMemory(str(tmp_path), JOB, "node0", fault_hook=crash_at(CrashPoint.T1_MID_WRITE))
    with pytest.raises(Crash):
        tier.save_draft(draft_diff_batch(steps, job_id=JOB, layout=layout(0)))
    assert tier.list() == []
    assert tier.sweep_incomplete(0) == [PayloadId.diff(1, 5)]



def _inode(tmp_path, rank: int, pid: PayloadId) -> int:
    return os.stat(tmp_path / JOB / "node0" / "own" / f"rank{rank:05d}" / f"{pid.dirname}.safetensors").st_ino


def _spares(tmp_path) -> list:
    return [f for _, _, files in os.walk(tmp_path / JOB / "node0" / "spare") for f in files]


def test_a_deleted_unit_file_is_written_over_by_the_next_unit_of_its_size(tmp_path):
    from megatier.checkpoint.format.payload import draft_base

    tier = NodeMemory(str(tmp_path), JOB, "node0")
    n = 1000
    states = [BaseState(v, v, torch.randn(n), torch.randn(n), torch.rand(n), {}, None, {"consumed_samples": v})
              for v in (50, 100)]
    first = tier.save_draft(draft_base(states[0], job_id=JOB, layout=layout(0)))
    inode = _inode(tmp_path, 0, PayloadId.base(50))
    first.data.close()  # nothing maps it any more: its file may become a spare
    tier.delete(0, PayloadId.base(50))
    assert len(_spares(tmp_path)) == 1 and tier.entries() == []
    assert tier.bytes_held() == first.stamp.size  # a spare counts as memory held
    second = tier.save_draft(draft_base(states[1], job_id=JOB, layout=layout(0)))
    assert _inode(tmp_path, 0, PayloadId.base(100)) == inode and _spares(tmp_path) == []
    assert bytes(second.data) == encode_base(states[1], job_id=JOB, layout=layout(0)).data
    assert tier.load(0, PayloadId.base(100)).data == bytes(second.data)
    # A smaller unit written over a larger spare is cut to its own size.
    second.data.close()
    tier.delete(0, PayloadId.base(100))
    small = BaseState(150, 150, torch.randn(600), torch.randn(600), torch.rand(600), {}, None, {})
    third = tier.save_draft(draft_base(small, job_id=JOB, layout=layout(0)))
    assert _inode(tmp_path, 0, PayloadId.base(150)) == inode
    assert tier.load(0, PayloadId.base(150)).data == bytes(third.data) == encode_base(
        small, job_id=JOB, layout=layout(0)).data


def test_a_file_still_mapped_is_never_made_a_spare(tmp_path):
    from megatier.checkpoint.format.payload import draft_diff_batch

    tier = NodeMemory(str(tmp_path), JOB, "node0")
    steps = [DiffStep(s, 1e-3, s, False, {"g": torch.full((64,), float(s))}, {}) for s in range(1, 6)]
    held = tier.save_draft(draft_diff_batch(steps, job_id=JOB, layout=layout(0)))
    before = bytes(held.data)
    tier.delete(0, PayloadId.diff(1, 5))  # a Tier-3 upload may still be reading this map
    assert _spares(tmp_path) == []
    later = [DiffStep(s, 1e-3, s, False, {"g": torch.full((64,), -1.0)}, {}) for s in range(6, 11)]
    tier.save_draft(draft_diff_batch(later, job_id=JOB, layout=layout(0)))
    assert bytes(held.data) == before  # what the holder reads did not change


def test_spares_are_bounded_swept_with_their_area_and_released(tmp_path):
    from megatier.checkpoint.storage.spare import SparePool

    tier = NodeMemory(str(tmp_path), JOB, "node0")
    for v in range(1, 4):
        tier.save(base_payload(v))
        tier.delete(0, PayloadId.base(v))
    assert len(_spares(tmp_path)) == 1  # each save took the spare the delete before it left
    tier.save(base_payload(9))
    tier.delete(0, PayloadId.base(9))
    assert tier.release_spares() > 0 and _spares(tmp_path) == [] and tier.bytes_held() == 0
    # A crashed launch's spares go with its area's sweep.
    tier.save(base_payload(10))
    tier.delete(0, PayloadId.base(10))
    assert tier.sweep_incomplete(0) == [] and _spares(tmp_path) == []
    # Closing keeps none from then on; a foreign area (an orphan's) never gets a pool.
    tier.save(base_payload(11), replica=False)
    tier.release_spares(for_good=True)
    tier.delete(0, PayloadId.base(11))
    tier.delete(3, PayloadId.base(1))
    assert _spares(tmp_path) == []
    pool = SparePool(str(tmp_path), "own/rank00007", max_files=2)
    files = []
    for i in range(3):
        path = tmp_path / f"f{i}"
        path.write_bytes(b"x" * (100 + i))
        files.append(pool.give(str(path)))
    assert files == [True, True, False] and len(pool) == 2 and pool.nbytes == 201
    assert pool.take(1000) is None and pool.take(20) is None  # only within a factor two of the size
    assert os.path.getsize(pool.take(101)) == 101 and os.path.getsize(pool.take(150)) == 100


def test_the_restore_history_round_trips_and_an_unreadable_one_is_none(tmp_path):
    memory = NodeMemory(str(tmp_path), "job", "node0")
    assert memory.read_restores() == []
    history = [{"n": 2, "version": 20, "end": 20, "mark": 25, "level": 1, "reached": 25, "clean": True}]
    memory.write_restores(history)
    assert memory.read_restores() == history
    memory.store.put("restores.json", b"\x00garbage")
    assert memory.read_restores() == []
