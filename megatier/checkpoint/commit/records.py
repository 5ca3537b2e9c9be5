"""Tier-3 object layout and the two-phase commit that makes a unit a recovery source.

Keys inside the job's store (``<remote.url>/<job_id>/``)::

    base/v00000050/rank00003.<xxh64>.safetensors            rank 3's payload (content-addressed)
    base/v00000050/rank00003.done.json                      rank 3's done marker
    base/v00000050/_COMMITTED                               the commit record of the unit
    diff/v00000046-00000050/rank00003.<xxh64>.safetensors   diff batches: the same three kinds
    diff/v00000046-00000050/rank00003.done.json
    diff/v00000046-00000050/_COMMITTED

Protocol (phase 1 by every rank's uploader, phase 2 by the coordinator):
1. A rank uploads its payload, then writes its done marker: the payload's key
   and stamp (size, xxh64, job id, layout) and the uploader's incarnation.
2. The coordinator (global rank 0) writes ``_COMMITTED`` with a conditional
   create only once it has seen a marker from every rank, all from one
   incarnation, whose objects are listed with the stamped sizes. The record
   names every object, its size and checksum, and the layout.

Why payload keys carry their checksum: an object is never overwritten with
different bytes. A relaunched job that saves a unit again writes new keys, so a
commit built from older markers still names objects that hold exactly the
bytes it records. Why one incarnation: shards from two runs of the same version
(possible after a lossy replay) are never mixed in one commit.

Nothing without ``_COMMITTED`` is ever returned by :class:`RemoteReader`.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Optional

from megatier.checkpoint.format.units import FaultHook, PayloadId, rank_name
from megatier.checkpoint.format.payload import FORMAT, EncodedPayload, PayloadError, Stamp, verify_payload
from megatier.checkpoint.tiers.store import ObjectNotFound, ObjectStore

T3_BEFORE_COMMIT = "t3.before_commit"
COMMITTED = "_COMMITTED"
_MARKER = re.compile(r"^rank(\d{5})\.done\.json$")


class CommitError(Exception):
    """Markers that can never form a valid commit (another job, inconsistent layouts, corrupt JSON)."""


def object_key(stamp: Stamp) -> str:
    """Key of a rank's payload object: content-addressed by its xxh64, so it is never overwritten."""
    return f"{stamp.pid.dirname}/{rank_name(stamp.rank)}.{stamp.xxh64}.safetensors"


def marker_key(pid: PayloadId, rank: int) -> str:
    """Key of a rank's done marker for a unit."""
    return f"{pid.dirname}/{rank_name(rank)}.done.json"


def commit_key(pid: PayloadId) -> str:
    """Key of a unit's commit record."""
    return f"{pid.dirname}/{COMMITTED}"


@dataclass(frozen=True)
class DoneMarker:
    """Phase 1: one rank's statement that ``key`` holds its payload for the unit."""

    key: str
    stamp: Stamp
    incarnation: str

    def to_dict(self) -> dict:
        return {"format": FORMAT, "key": self.key, "stamp": self.stamp.to_dict(), "incarnation": self.incarnation}

    @classmethod
    def from_dict(cls, d: dict, source: str) -> "DoneMarker":
        try:
            return cls(str(d["key"]), Stamp.from_dict(d["stamp"], source), str(d["incarnation"]))
        except (KeyError, TypeError, PayloadError) as e:
            raise CommitError(f"{source}: malformed done marker ({type(e).__name__}: {e}); delete it so the "
                              f"rank's uploader can write it again") from e

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, source: str) -> "DoneMarker":
        try:
            d = json.loads(data)
        except ValueError as e:
            raise CommitError(f"{source}: done marker is not valid JSON ({e}); delete it so the rank's uploader "
                              f"can write it again") from e
        return cls.from_dict(d, source)


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

    def to_json(self) -> bytes:
        tp, pp, dp = self.degrees
        return json.dumps({"format": FORMAT, **self.pid.to_dict(), "job_id": self.job_id,
                           "layout": {"tp": tp, "pp": pp, "dp": dp}, "world_size": self.world_size,
                           "incarnation": self.incarnation, "ranks": [m.to_dict() for m in self.ranks]},
                          sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, source: str) -> "CommitRecord":
        try:
            d = json.loads(data)
            ranks = tuple(DoneMarker.from_dict(m, source) for m in d["ranks"])
            layout = d["layout"]
            record = cls(PayloadId.from_dict(d), str(d["job_id"]),
                         (int(layout["tp"]), int(layout["pp"]), int(layout["dp"])), str(d["incarnation"]), ranks)
            world_size = int(d["world_size"])
        except (ValueError, KeyError, TypeError, CommitError) as e:
            raise PayloadError(f"{source}: malformed commit record ({e}); the unit cannot be used as a "
                               f"recovery source") from e
        if len(ranks) != world_size or any(m.stamp.rank != r for r, m in enumerate(ranks)):
            raise PayloadError(f"{source}: commit record lists ranks out of order or a wrong count")
        return record


def _read_markers(store: ObjectStore, pid: PayloadId, world_size: int, listing: dict[str, int],
                  job_id: str) -> Optional[list[DoneMarker]]:
    """Every rank's marker if all are present, readable and point at listed objects; else None."""
    if any(marker_key(pid, r) not in listing for r in range(world_size)):
        return None
    markers = []
    for r in range(world_size):
        key = marker_key(pid, r)
        try:
            m = DoneMarker.from_json(store.get(key), store.describe(key))
        except ObjectNotFound:
            return None  # deleted since the listing (reclaimed): not committable now
        s = m.stamp
        if s.job_id != job_id or s.pid != pid or s.rank != r or s.layout.world_size != world_size:
            raise CommitError(f"{store.describe(key)}: marker for {s.pid} of rank {s.rank} in job {s.job_id!r} "
                              f"(world {s.layout.world_size}) does not belong to {pid} of rank {r} in job "
                              f"{job_id!r} (world {world_size}); two jobs may share checkpoint.job_id")
        if listing.get(m.key) != s.size:
            return None  # the object is missing or not the stamped size: never commit it
        markers.append(m)
    return markers


class Committer:
    """Phase 2, run by the coordinator (global rank 0) only.

    Run Tier-3 reclamation in the same thread as :meth:`try_commit` so a unit is
    never committed while its objects are being deleted.
    """

    def __init__(self, store: ObjectStore, job_id: str, *, fault_hook: Optional[FaultHook] = None):
        self.store = store
        self.job_id = job_id
        self.fault_hook = fault_hook

    def try_commit(self, pid: PayloadId, world_size: int,
                   listing: Optional[dict[str, int]] = None) -> Optional[CommitRecord]:
        """Commit ``pid`` if every rank's marker is in; returns the (new or existing) record, else None.

        ``listing`` (the unit's keys and sizes, from a listing just taken) saves
        the store a listing and, when it shows no commit record, a failed read.
        """
        if listing is None or commit_key(pid) in listing:
            existing = self._existing(pid)
            if existing is not None:
                return existing
        if listing is None:
            listing = self.store.list(f"{pid.dirname}/")
        markers = _read_markers(self.store, pid, world_size, listing, self.job_id)
        if markers is None or len({m.incarnation for m in markers}) != 1:
            return None
        degrees = {m.stamp.layout.degrees for m in markers}
        if len(degrees) != 1:
            raise CommitError(f"{self.store.describe(pid.dirname)}: ranks report different layouts {sorted(degrees)}")
        record = CommitRecord(pid, self.job_id, degrees.pop(), markers[0].incarnation, tuple(markers))
        if self.fault_hook is not None:
            self.fault_hook(T3_BEFORE_COMMIT, pid.version)
        if self.store.put_if_absent(commit_key(pid), record.to_json()):
            return record
        # Someone (or a retried request of ours) committed first; the first commit stands.
        return self._existing(pid)

    def _existing(self, pid: PayloadId) -> Optional[CommitRecord]:
        key = commit_key(pid)
        try:
            return CommitRecord.from_json(self.store.get(key), self.store.describe(key))
        except ObjectNotFound:
            return None

    def commit_pending(self, world_size: int,
                       units: Optional[dict[PayloadId, "UnitListing"]] = None) -> list[CommitRecord]:
        """Commit every unit that has all its markers but no commit record, oldest first; returns the new commits.

        ``units`` is a fresh :func:`list_units` (taken here if not given); the
        units committed now are marked committed in it.
        """
        units = list_units(self.store) if units is None else units
        new = []
        for pid, unit in sorted(units.items(), key=lambda kv: (kv[0].last, kv[0].kind)):
            if unit.committed or len(set(unit.markers)) < world_size:
                continue
            record = self.try_commit(pid, world_size, listing=unit.objects)
            if record is not None:
                unit.committed = True
                new.append(record)
        return new


@dataclass
class UnitListing:
    """The objects of one unit directory on Tier-3."""

    committed: bool = False
    markers: list[int] = field(default_factory=list)
    objects: dict[str, int] = field(default_factory=dict)  # every key of the unit -> size


def list_units(store: ObjectStore) -> dict[PayloadId, UnitListing]:
    """Group the job's Tier-3 keys by unit (one listing call); keys outside the layout are ignored."""
    units: dict[PayloadId, UnitListing] = {}
    for key, size in store.list("").items():
        head, _, name = key.rpartition("/")
        pid = PayloadId.from_dirname(head)
        if pid is None:
            continue
        unit = units.setdefault(pid, UnitListing())
        unit.objects[key] = size
        if name == COMMITTED:
            unit.committed = True
        elif (m := _MARKER.match(name)) is not None:
            unit.markers.append(int(m.group(1)))
    return units


class RemoteReader:
    """Read side of Tier-3: committed units only, every payload checksum-verified."""

    def __init__(self, store: ObjectStore, job_id: str):
        self.store = store
        self.job_id = job_id
        self._records: dict[PayloadId, CommitRecord] = {}  # commit records are immutable once written

    def committed(self) -> list[CommitRecord]:
        """Every unit committed now (reclaimed ones drop out), sorted by (last step, kind)."""
        current = [pid for pid, unit in list_units(self.store).items() if unit.committed]
        for pid in set(self._records) - set(current):
            del self._records[pid]
        for pid in current:
            if pid not in self._records:
                key = commit_key(pid)
                record = CommitRecord.from_json(self.store.get(key), self.store.describe(key))
                if record.job_id != self.job_id or record.pid != pid:
                    raise PayloadError(f"{self.store.describe(key)}: record of {record.pid} in job "
                                       f"{record.job_id!r}, expected {pid} in job {self.job_id!r}")
                self._records[pid] = record
        return sorted((self._records[pid] for pid in current), key=lambda r: (r.pid.last, r.pid.kind))

    def committed_bases(self) -> list[int]:
        return [r.pid.version for r in self.committed() if r.pid.kind == "base"]

    def committed_diffs(self) -> list[tuple[int, int]]:
        return [(r.pid.first, r.pid.last) for r in self.committed() if r.pid.kind == "diff"]

    def record(self, pid: PayloadId) -> CommitRecord:
        """The commit record of ``pid``; ObjectNotFound (naming the unit) if it is not committed."""
        if pid not in self._records:
            key = commit_key(pid)
            try:
                data = self.store.get(key)
            except ObjectNotFound as e:
                raise ObjectNotFound(f"{self.store.describe(pid.dirname)}: {pid} is not committed on Tier-3") from e
            self._records[pid] = CommitRecord.from_json(data, self.store.describe(key))
        return self._records[pid]

    def load(self, pid: PayloadId, rank: int) -> EncodedPayload:
        """Rank ``rank``'s payload of a committed unit, verified against the commit record."""
        record = self.record(pid)
        if not 0 <= rank < record.world_size:
            raise ValueError(f"rank {rank} is outside the committed world of {record.world_size} ranks for {pid}")
        marker = record.ranks[rank]
        data = self.store.get(marker.key)
        verify_payload(data, marker.stamp, self.store.describe(marker.key))
        return EncodedPayload(data, marker.stamp)
