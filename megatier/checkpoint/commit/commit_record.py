"""A Tier-3 unit's commit record, in parts that each node's leader reads for its own ranks only.

Keys inside the unit's directory (see :mod:`.records` for the rest)::

    _COMMITTED                                  the header: unit, job, config, layout, world, incarnation,
                                                and every part's key, size and xxh64
    _ranks.000000-000256.<xxh64>.json           the done markers of ranks 0 .. 255, in rank order

Why parts: the record names every rank's payload (its key, size and checksum),
so one record of a 100k-rank job is about 135 MiB of JSON. Read whole, it made
rank 0's restore decision O(world) (docs/benchmarks.md, "The decision from
per-node summaries"). With parts, rank 0 decides from headers (a few KiB: one
line a part) and each node's leader reads the part holding its ranks
(:func:`read_markers`), so no process reads more than its own share and the
headers.

Why the header is written last, with a conditional create: it is what makes the
unit a recovery source, so it never names a part that is not there. Parts are
content-addressed like payloads: a retried or repeated commit writes the same
bytes under the same key, never different bytes under one key. Records written
before parts existed (every marker inline under ``ranks``) are still read.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

from megatier.checkpoint.commit.records import CommitError, DoneMarker, commit_key
from megatier.checkpoint.format.payload import FORMAT, PayloadError, checksum
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.storage.store import ObjectStore

PART_RANKS = 256  # ranks per part: a leader of 8 ranks reads one part; rank 0 reads world / 256 header lines


@dataclass(frozen=True)
class CommitRecord:
    """Phase 2: the unit is a recovery source; ``ranks[r]`` is rank r's marker."""

    pid: PayloadId
    job_id: str
    degrees: tuple[int, int, int]  # (tp, pp, dp)
    incarnation: str
    ranks: tuple[DoneMarker, ...] = field(repr=False)

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def total_bytes(self) -> int:
        return sum(m.stamp.size for m in self.ranks)

    def objects(self) -> tuple[bytes, dict[str, bytes]]:
        """The header's bytes, and every part's key -> bytes."""
        parts: dict[str, bytes] = {}
        refs = []
        for lo in range(0, self.world_size, PART_RANKS):
            hi = min(lo + PART_RANKS, self.world_size)
            data = json.dumps([m.to_dict() for m in self.ranks[lo:hi]], sort_keys=True).encode()
            digest = checksum(data)
            key = f"{self.pid.dirname}/_ranks.{lo:06d}-{hi:06d}.{digest}.json"
            parts[key] = data
            refs.append({"lo": lo, "hi": hi, "key": key, "size": len(data), "xxh64": digest})
        tp, pp, dp = self.degrees
        fingerprint = self.ranks[0].stamp.fingerprint if self.ranks else ""
        header = json.dumps({"format": FORMAT, **self.pid.to_dict(), "job_id": self.job_id,
                             "layout": {"tp": tp, "pp": pp, "dp": dp}, "world_size": self.world_size,
                             "incarnation": self.incarnation, "fingerprint": fingerprint, "parts": refs},
                            sort_keys=True).encode()
        return header, parts


@dataclass(frozen=True)
class PartRef:
    """One part of a record: the markers of ranks ``lo`` .. ``hi`` - 1 under ``key``."""

    lo: int
    hi: int
    key: str
    size: int
    xxh64: str


@dataclass(frozen=True)
class RecordHeader:
    """``_COMMITTED`` as read: everything but the markers, which are in ``parts`` (or ``inline``, for a record
    written before parts existed)."""

    pid: PayloadId
    job_id: str
    degrees: tuple[int, int, int]
    incarnation: str
    world_size: int
    fingerprint: str
    parts: tuple[PartRef, ...] = ()
    inline: Optional[tuple[DoneMarker, ...]] = field(default=None, repr=False)


def write_record(store: ObjectStore, record: CommitRecord) -> bool:
    """Write the parts, then the header if none is there; whether this call wrote the header."""
    header, parts = record.objects()
    for key, data in parts.items():
        store.put(key, data)
    return store.put_if_absent(commit_key(record.pid), header)


def _malformed(source: str, e: Exception) -> PayloadError:
    return PayloadError(f"{source}: malformed commit record ({type(e).__name__}: {e}); the unit cannot be used "
                        f"as a recovery source")


def parse_header(data: bytes, source: str) -> RecordHeader:
    """A header from its bytes (either format); PayloadError naming ``source`` if it is malformed."""
    try:
        d = json.loads(data)
        layout = d["layout"]
        degrees = (int(layout["tp"]), int(layout["pp"]), int(layout["dp"]))
        world, pid = int(d["world_size"]), PayloadId.from_dict(d)
        if "ranks" in d:  # written before parts: every marker inline
            inline = tuple(DoneMarker.from_dict(m, source) for m in d["ranks"])
            _check_ranks(inline, 0, world, source)
            fingerprint = inline[0].stamp.fingerprint if inline else ""
            return RecordHeader(pid, str(d["job_id"]), degrees, str(d["incarnation"]), world, fingerprint,
                                inline=inline)
        parts = tuple(PartRef(int(p["lo"]), int(p["hi"]), str(p["key"]), int(p["size"]), str(p["xxh64"]))
                      for p in d["parts"])
        header = RecordHeader(pid, str(d["job_id"]), degrees, str(d["incarnation"]), world, str(d["fingerprint"]),
                              parts)
    except (ValueError, KeyError, TypeError, CommitError) as e:
        raise _malformed(source, e) from e
    if [(p.lo, p.hi) for p in parts] != [(lo, min(lo + PART_RANKS, world)) for lo in range(0, world, PART_RANKS)]:
        raise PayloadError(f"{source}: commit record's parts do not tile its {world} ranks; the unit cannot be "
                           f"used as a recovery source")
    return header


def _check_ranks(markers: tuple[DoneMarker, ...], lo: int, hi: int, source: str) -> None:
    if len(markers) != hi - lo or any(m.stamp.rank != lo + i for i, m in enumerate(markers)):
        raise PayloadError(f"{source}: commit record lists ranks out of order or a wrong count")


def read_header(store: ObjectStore, pid: PayloadId) -> RecordHeader:
    """``pid``'s header; ObjectNotFound if it is not committed, PayloadError if it is malformed or another
    unit's."""
    key = commit_key(pid)
    header = parse_header(store.get(key), store.describe(key))
    if header.pid != pid:
        raise PayloadError(f"{store.describe(key)}: {key.rpartition('/')[2]} describes {header.pid}")
    return header


def read_markers(store: ObjectStore, header: RecordHeader, lo: int, hi: int) -> list[DoneMarker]:
    """The markers of ranks ``lo`` .. ``hi`` - 1 (clipped to the world), reading only the parts that hold them,
    each checked against the header's size and xxh64."""
    lo, hi = max(lo, 0), min(hi, header.world_size)
    if header.inline is not None:
        return list(header.inline[lo:hi])
    out: list[DoneMarker] = []
    for ref in header.parts:
        if ref.hi <= lo or ref.lo >= hi:
            continue
        data, source = store.get(ref.key), store.describe(ref.key)
        if len(data) != ref.size or checksum(data) != ref.xxh64:
            raise PayloadError(f"{source}: commit record part is not the bytes its header names (size "
                               f"{len(data)}, xxh64 {checksum(data)}); the unit cannot be used as a recovery source")
        try:
            markers = tuple(DoneMarker.from_dict(m, source) for m in json.loads(data))
        except (ValueError, TypeError, CommitError) as e:
            raise _malformed(source, e) from e
        _check_ranks(markers, ref.lo, ref.hi, source)
        out.extend(markers[max(lo, ref.lo) - ref.lo:min(hi, ref.hi) - ref.lo])
    return out


def read_record(store: ObjectStore, pid: PayloadId) -> CommitRecord:
    """``pid``'s whole record (every part); errors as :func:`read_header`."""
    header = read_header(store, pid)
    markers = tuple(read_markers(store, header, 0, header.world_size))
    return CommitRecord(header.pid, header.job_id, header.degrees, header.incarnation, markers)
