"""Phase 2 of the Tier-3 commit (see :mod:`.records`), run by the coordinator (global rank 0) only."""
from __future__ import annotations

from typing import Optional

from megatier.checkpoint.commit.commit_record import CommitRecord, read_record, write_record
from megatier.checkpoint.commit.records import (
    CommitError,
    DoneMarker,
    UnitListing,
    commit_key,
    list_units,
    marker_key,
)
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.storage.store import ObjectNotFound, ObjectStore
from megatier.faults import CrashPoint, FaultHook, no_faults


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
        if s.job_id != job_id or s.pid != pid or s.rank != r:
            raise CommitError(f"{store.describe(key)}: marker for {s.pid} of rank {s.rank} in job {s.job_id!r} "
                              f"does not belong to {pid} of rank {r} in job {job_id!r}; two jobs may share "
                              f"checkpoint.job_id")
        if s.layout.world_size != world_size:
            return None  # written by an earlier layout of this job (before a resharded restore): never ours
        if listing.get(m.key) != s.size:
            return None  # the object is missing or not the stamped size: never commit it
        markers.append(m)
    return markers


class Committer:
    """Phase 2, run by the coordinator (global rank 0) only.

    Run Tier-3 reclamation in the same thread as :meth:`try_commit` so a unit is
    never committed while its objects are being deleted.
    """

    def __init__(self, store: ObjectStore, job_id: str, *, fault_hook: FaultHook = no_faults):
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
        if len(degrees) != 1 or len({m.stamp.fingerprint for m in markers}) != 1:
            return None  # markers of two layouts or configs of this job (one reshard apart): none is complete
        record = CommitRecord(pid, self.job_id, degrees.pop(), markers[0].incarnation, tuple(markers))
        self.fault_hook(CrashPoint.T3_BEFORE_COMMIT, pid.version)
        if write_record(self.store, record):
            return record
        # Someone (or a retried request of ours) committed first; the first commit stands.
        return self._existing(pid)

    def _existing(self, pid: PayloadId) -> Optional[CommitRecord]:
        try:
            return read_record(self.store, pid)
        except ObjectNotFound:
            return None

    def commit_pending(self, world_size: int,
                       units: Optional[dict[PayloadId, UnitListing]] = None) -> list[CommitRecord]:
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
