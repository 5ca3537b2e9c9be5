"""The read side of Tier-3: committed units only, every payload checksum-verified."""
from __future__ import annotations

from megatier.checkpoint.commit.records import CommitRecord, commit_key, list_units
from megatier.checkpoint.format.payload import EncodedPayload, PayloadError, verify_payload
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.storage.store import ObjectNotFound, ObjectStore


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
