"""The read side of Tier-3: committed units only, every payload checksum-verified."""
from __future__ import annotations

from megatier.checkpoint.commit.commit_record import CommitRecord, RecordHeader, read_header, read_markers, read_record
from megatier.checkpoint.commit.records import DoneMarker, list_units
from megatier.checkpoint.format.payload import EncodedPayload, PayloadError, verify_payload
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.storage.store import ObjectNotFound, ObjectStore


class RemoteReader:
    """Read side of Tier-3: committed units only, every payload checksum-verified."""

    def __init__(self, store: ObjectStore, job_id: str):
        self.store = store
        self.job_id = job_id
        self._records: dict[PayloadId, CommitRecord] = {}  # commit records are immutable once written
        self._headers: dict[PayloadId, RecordHeader] = {}

    def committed(self) -> list[CommitRecord]:
        """Every unit committed now (reclaimed ones drop out), sorted by (last step, kind)."""
        current = [pid for pid, unit in list_units(self.store).items() if unit.committed]
        for pid in set(self._records) - set(current):
            del self._records[pid]
        for pid in set(self._headers) - set(current):
            del self._headers[pid]
        for pid in current:
            if pid not in self._records:
                record = read_record(self.store, pid)
                if record.job_id != self.job_id:
                    raise PayloadError(f"{self.store.describe(pid.dirname)}: record of {record.pid} in job "
                                       f"{record.job_id!r}, expected job {self.job_id!r}")
                self._records[pid] = record
        return sorted((self._records[pid] for pid in current), key=lambda r: (r.pid.last, r.pid.kind))

    def committed_bases(self) -> list[int]:
        return [r.pid.version for r in self.committed() if r.pid.kind == "base"]

    def committed_diffs(self) -> list[tuple[int, int]]:
        return [(r.pid.first, r.pid.last) for r in self.committed() if r.pid.kind == "diff"]

    def record(self, pid: PayloadId) -> CommitRecord:
        """The whole commit record of ``pid``; ObjectNotFound (naming the unit) if it is not committed."""
        if pid not in self._records:
            self._records[pid] = read_record(self.store, self._header(pid).pid)
        return self._records[pid]

    def _header(self, pid: PayloadId) -> RecordHeader:
        if pid not in self._headers:
            try:
                self._headers[pid] = read_header(self.store, pid)
            except ObjectNotFound as e:
                raise ObjectNotFound(f"{self.store.describe(pid.dirname)}: {pid} is not committed on Tier-3") from e
        return self._headers[pid]

    def marker(self, pid: PayloadId, rank: int) -> DoneMarker:
        """Rank ``rank``'s marker in ``pid``'s record, reading the header and the one part that holds it."""
        if pid in self._records:
            record = self._records[pid]
            world, markers = record.world_size, record.ranks[rank:rank + 1]
        else:
            header = self._header(pid)
            world, markers = header.world_size, read_markers(self.store, header, rank, rank + 1)
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside the committed world of {world} ranks for {pid}")
        return markers[0]

    def load(self, pid: PayloadId, rank: int) -> EncodedPayload:
        """Rank ``rank``'s payload of a committed unit, verified against the commit record."""
        marker = self.marker(pid, rank)
        data = self.store.get(marker.key)
        verify_payload(data, marker.stamp, self.store.describe(marker.key))
        return EncodedPayload(data, marker.stamp)
