"""The commit record in parts: rank 0 reads headers, a node's leader the part holding its ranks."""
from __future__ import annotations

import json

import pytest

from megatier.checkpoint.commit import commit_record
from megatier.checkpoint.commit.commit_record import (
    CommitRecord,
    parse_header,
    read_header,
    read_markers,
    read_record,
    write_record,
)
from megatier.checkpoint.commit.records import DoneMarker, commit_key, object_key
from megatier.checkpoint.format.payload import FORMAT, PayloadError, Stamp
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.storage.directory import DirectoryStore
from megatier.parallel.layout import Layout, coordinates_of
from tests.checkpoint_fakes import JOB

TP, DP = 2, 5  # a world of 10 ranks, 3 to a part below: parts [0, 3) [3, 6) [6, 9) [9, 10)


def _record(pid: PayloadId, world: int = TP * DP) -> CommitRecord:
    markers = []
    for r in range(world):
        tp_rank, dp_rank, pp_rank = coordinates_of(r, tp=TP, dp=DP)
        stamp = Stamp(pid, 100 + r, f"{r:016x}", JOB, Layout(TP, 1, DP, tp_rank, pp_rank, dp_rank), "fp1")
        markers.append(DoneMarker(object_key(stamp), stamp, "inc-a"))
    return CommitRecord(pid, JOB, (TP, 1, DP), "inc-a", tuple(markers))


class CountingStore(DirectoryStore):
    """Counts the keys it is asked for."""

    def __init__(self, root: str):
        super().__init__(root)
        self.gets: list[str] = []

    def get(self, key: str) -> bytes:
        self.gets.append(key)
        return super().get(key)


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setattr(commit_record, "PART_RANKS", 3)
    return CountingStore(str(tmp_path / "job"))


def test_the_parts_tile_the_world_and_read_back_as_the_record(store):
    pid = PayloadId.base(50)
    record = _record(pid)
    assert write_record(store, record) and not write_record(store, record)  # the first commit stands
    header = read_header(store, pid)
    assert [(p.lo, p.hi) for p in header.parts] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert (header.world_size, header.degrees, header.fingerprint) == (10, (TP, 1, DP), "fp1")
    assert read_record(store, pid) == record


def test_a_leader_reads_only_the_parts_of_its_ranks(store):
    pid = PayloadId.diff(51, 55)
    record = _record(pid)
    write_record(store, record)
    header = read_header(store, pid)
    store.gets.clear()
    assert read_markers(store, header, 4, 6) == list(record.ranks[4:6])
    assert len(store.gets) == 1  # the part [3, 6) only
    store.gets.clear()
    assert read_markers(store, header, 5, 7) == list(record.ranks[5:7])
    assert len(store.gets) == 2
    assert read_markers(store, header, 9, 40) == [record.ranks[9]]  # clipped to the world


def test_a_part_that_is_not_the_bytes_its_header_names_is_refused(store):
    pid = PayloadId.base(50)
    write_record(store, _record(pid))
    header = read_header(store, pid)
    part = header.parts[1]
    store.put(part.key, store.get(part.key).replace(b"inc-a", b"inc-b"))
    with pytest.raises(PayloadError, match="not the bytes its header names"):
        read_markers(store, header, 3, 4)
    assert read_markers(store, header, 0, 3) == list(_record(pid).ranks[0:3])  # the other parts still read


def test_a_header_whose_parts_do_not_tile_the_world_is_refused(store):
    pid = PayloadId.base(50)
    header, _ = _record(pid).objects()
    d = json.loads(header)
    d["parts"] = d["parts"][:-1]
    with pytest.raises(PayloadError, match="do not tile its 10 ranks"):
        parse_header(json.dumps(d).encode(), "test")


def test_a_record_written_before_parts_is_still_read(store):
    """Records with every marker inline under ``ranks`` (the format before parts)."""
    pid = PayloadId.base(50)
    record = _record(pid)
    store.put(commit_key(pid), json.dumps({
        "format": FORMAT, **pid.to_dict(), "job_id": JOB, "layout": {"tp": TP, "pp": 1, "dp": DP},
        "world_size": 10, "incarnation": "inc-a", "ranks": [m.to_dict() for m in record.ranks]}).encode())
    header = read_header(store, pid)
    assert header.parts == () and header.fingerprint == "fp1"
    assert read_markers(store, header, 2, 4) == list(record.ranks[2:4])
    assert read_record(store, pid) == record
