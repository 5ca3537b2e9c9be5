"""Tier-3: remote storage (a directory on a shared file system, or S3), written through the commit protocol.

Survives everything, a rack failure included. ``checkpoint.remote.url`` is a
directory path (relative paths resolve against the working directory),
``file:///path``, or ``s3://bucket[/prefix]``; every job lives under
``<url>/<job_id>/`` (the object layout: :mod:`megatier.checkpoint.commit.records`).

Every rank's payloads go to its :class:`Uploader` (phase 1: objects, then a
done marker); global rank 0 also runs the :class:`Coordinator` (phase 2:
``_COMMITTED``, and Tier-3 reclamation). Only committed units are ever listed
or read back.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Optional
from urllib.parse import urlparse

from megatier.checkpoint.commit.commit_record import RecordHeader, read_header, read_markers
from megatier.checkpoint.commit.committer import Committer
from megatier.checkpoint.commit.coordinator import Coordinator, NoCoordinator
from megatier.checkpoint.commit.lease import LeaseHeld, OwnerLease
from megatier.checkpoint.commit.reader import RemoteReader
from megatier.checkpoint.commit.records import (
    COMMITTED,
    SUPERSEDED,
    CommitError,
    delete_unit,
    list_units,
    set_aside,
    unit_ids,
)
from megatier.checkpoint.commit.uploader import Uploader
from megatier.checkpoint.format.payload import EncodedPayload, PayloadError
from megatier.checkpoint.format.units import PayloadId, check_path_component, rank_name
from megatier.checkpoint.policy.rules import check_remote_url
from megatier.checkpoint.reclaim.executor import delete_units
from megatier.checkpoint.reclaim.policy import beyond_end
from megatier.checkpoint.storage.directory import DirectoryStore
from megatier.checkpoint.storage.s3 import S3Store
from megatier.checkpoint.storage.store import ObjectNotFound, ObjectStore, RetryPolicy, StoreError
from megatier.checkpoint.threads import helper_thread
from megatier.checkpoint.tiers.base import JOB, TIER3, Copy, Listing, Tier
from megatier.checkpoint.tiers.node_memory import read_fingerprints, read_history, write_history
from megatier.faults import FaultHook, no_faults

log = logging.getLogger(__name__)


def open_remote_store(url: str, job_id: str, *, endpoint_url: Optional[str] = None,
                      retry: RetryPolicy = RetryPolicy(), connect_timeout_s: float = 5.0,
                      read_timeout_s: float = 60.0, fsync: bool = True) -> ObjectStore:
    """The store rooted at ``<url>/<job_id>/``; raises ConfigError for an unsupported url.

    Nothing is contacted here; call ``store.check()`` to fail fast on an
    unreachable endpoint, a missing bucket or a read-only directory. ``fsync``
    applies to directories only (S3 objects are durable once the PUT returns).
    """
    check_remote_url(url, endpoint_url)
    check_path_component(job_id, "checkpoint.job_id")
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        prefix = "/".join(p for p in (parsed.path.strip("/"), job_id) if p)
        return S3Store(parsed.netloc, prefix, endpoint_url=endpoint_url, retry=retry,
                       connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s)
    path = parsed.path if parsed.scheme == "file" else url
    return DirectoryStore(f"{path.rstrip('/')}/{job_id}", fsync=fsync)


FINGERPRINTS = "_fingerprints/"
RESTORES = "_restores.json"


def committed_headers(store: ObjectStore) -> tuple[Listing, list[RecordHeader]]:
    """The committed units' record headers, oldest first, and the listing's facts (traces, fingerprints, the
    restore history) without copies: O(units) reads, whatever the world. Unreadable headers are noted and
    skipped."""
    pids = unit_ids(store)
    listing = Listing(traces=bool(pids), fingerprints=read_fingerprints(store, FINGERPRINTS),
                      restores=read_history(store, RESTORES))
    headers = []
    for pid in sorted(pids, key=lambda p: (p.last, p.kind)):
        try:
            headers.append(read_header(store, pid))
        except ObjectNotFound:
            continue  # not committed
        except (PayloadError, StoreError) as e:
            listing.notes.append(f"Tier-3 {pid}: {COMMITTED} unreadable ({e})")
    return listing, headers


def copies_in(store: ObjectStore, headers: list[RecordHeader], owners: list[tuple[int, int]],
              label: str = TIER3) -> tuple[list[Copy], list[str]]:
    """The copies of ``owners`` (half-open rank ranges) in the units of ``headers``, reading only the record
    parts that hold them; and a note per unit whose parts could not be read."""
    copies, notes = [], []
    for header in headers:
        try:
            markers = [m for lo, hi in owners for m in read_markers(store, header, lo, hi)]
        except (PayloadError, StoreError) as e:
            notes.append(f"Tier-3 {header.pid}: commit record unreadable ({e})")
            continue
        copies.extend(Copy(m.stamp, label, None) for m in markers)
    return copies, notes


def list_committed(store: ObjectStore, label: str = TIER3) -> Listing:
    """Every rank's copy of every committed unit, and the recorded config fingerprints; unreadable commit
    records are noted and skipped."""
    listing, headers = committed_headers(store)
    copies, notes = copies_in(store, headers, [(0, max((h.world_size for h in headers), default=0))], label)
    listing.copies.extend(copies)
    listing.notes.extend(notes)
    return listing


class RemoteTier(Tier):
    """Tier-3 of rank ``rank``: uploads its units; on global rank 0 also commits and reclaims.

    ``offline`` (why Tier-3 did not answer at start-up, None when it did): the launch started from node memory
    without it. Tier-3 is then not listed at restore (it counts as a trace, so a launch with nothing in node
    memory stops instead of starting fresh), and nothing is written to it until global rank 0 has reached it
    again, taken the job's lease (or stopped the run, when another live launch holds it), committed what the
    previous launch left and cleaned up after this launch's restore point; rank 0's readiness reaches the
    other ranks with the next watermark sync (:meth:`holds_job`, :meth:`allow_writes`).
    """

    label, scope = TIER3, JOB

    def __init__(self, store: ObjectStore, *, job_id: str, rank: int, world_size: int, incarnation: str,
                 keep_bases: int, drain_timeout_s: float = 120.0, lease: Optional[OwnerLease] = None,
                 fault: FaultHook = no_faults, offline: Optional[str] = None, reconnect_s: float = 2.0):
        self.store = store  # with retries: restore's listing and reads
        fast = store.fail_fast()  # the helper threads retry on their own, and must see a failure at once
        self.job_id = job_id
        self.world_size = world_size
        self.lists = rank == 0  # global rank 0 lists Tier-3, commits and records the config
        self.drain_timeout_s = drain_timeout_s
        self._left: list[PayloadId] = []  # what the uploader could not store by the end of drain()
        self._deadline: Optional[float] = None  # drain and close share drain_timeout_s
        self.lease = lease  # global rank 0's hold on the job's prefix (commit/lease.py); None elsewhere
        self.reader = RemoteReader(store, job_id)
        self.coordinator = (Coordinator(fast, job_id, world_size, keep_bases=keep_bases, fault_hook=fault)
                            if rank == 0 else NoCoordinator())  # polls from start(), after restore
        # The coordinator's rank nudges it after each of its own markers, naming the unit: no unit commits
        # without rank 0's marker, so that is when one may become complete (in a world of one, it is).
        self.uploader = Uploader(fast, job_id, rank, incarnation=incarnation, fault_hook=fault,
                                 on_done=self.coordinator.nudge, open_now=offline is None)
        self.offline = offline
        self._ready = offline is None  # rank 0: holds the lease and cleaned up; Tier-3 may be written
        self._deferred: dict = {}  # offline: restore's end and the config record, done once Tier-3 answers
        self._reconnect_s = reconnect_s
        self._stop = threading.Event()
        self._reconnect: Optional[threading.Thread] = None

    def where(self) -> str:
        return f"Tier-3 at {self.store.url}"

    # ---- units -------------------------------------------------------------------------------

    def put(self, payload: EncodedPayload) -> None:
        self.uploader.submit(payload)

    def list(self) -> Listing:
        if self.offline is not None:  # unknown, not empty: a trace, so a restore never starts fresh over it
            return Listing(traces=True, unknown=f"{self.where()} is {self.offline}",
                           notes=[f"{self.where()} was not consulted: {self.offline}"])
        return list_committed(self.store, self.label)

    def decision_listing(self) -> Listing:
        """The facts and the committed units' record headers, no copies (:func:`committed_headers`)."""
        if self.offline is not None:
            return self.list()
        listing, headers = committed_headers(self.store)
        listing.headers = headers
        return listing

    def copies_of(self, pids: list[PayloadId], owners: list[tuple[int, int]]) -> tuple[list[Copy], list[str]]:
        """A node leader's share of the restore: the copies of ``owners`` (rank ranges) in those of ``pids``
        that are committed, reading their headers and the record parts that hold these ranks only; and a note
        per unit that could not be read."""
        if self.offline is not None:
            return [], [f"{self.where()} was not consulted: {self.offline}"]
        headers, notes = [], []
        for pid in pids:
            try:
                headers.append(read_header(self.store, pid))
            except ObjectNotFound:
                continue  # not committed (the point names units held elsewhere too)
            except (PayloadError, StoreError) as e:
                notes.append(f"Tier-3 {pid}: {COMMITTED} unreadable ({e})")
        copies, unread = copies_in(self.store, headers, owners, self.label)
        return copies, notes + unread

    def read(self, copy: Copy) -> EncodedPayload:
        return self.reader.load(copy.pid, copy.owner)

    def delete(self, pid: PayloadId, owner: Optional[int] = None) -> None:
        keys = list(self.store.list(f"{pid.dirname}/"))
        if owner is not None:
            keys = [k for k in keys if k.rpartition("/")[2].startswith(f"{rank_name(owner)}.")]
        delete_unit(self.store, keys)

    # ---- save path ---------------------------------------------------------------------------

    def start(self) -> None:
        if self._ready:
            self.coordinator.start()
        elif self.lists:
            self._reconnect = helper_thread(self._reach_again, "megatier-t3-reconnect")
            self._reconnect.start()

    def _reach_again(self) -> None:
        """Rank 0 of a launch that started without Tier-3: wait until it answers, take the lease, catch up on
        what restore would have done there, then let the uploads and commits go."""
        delay = self._reconnect_s
        while not self._stop.wait(delay):
            delay = min(2 * delay, 30.0)
            try:
                self.store.fail_fast().check()
                self.lease.acquire()
                self._settle()
                gone = self._discard_after(self._deferred.get("end", 0))
                if "config" in self._deferred:
                    self._record_config(*self._deferred["config"])
            except LeaseHeld as e:
                self.lease.lost = str(e)  # point() stops the run at the next watermark sync
                return
            except StoreError as e:
                log.debug("Tier-3 at %s still unreachable: %s", self.store.url, e)
                continue
            self._ready = True
            self.coordinator.start()
            self.uploader.allow()
            log.warning("%s answers again: this launch holds its lease%s and uploads what it queued",
                        self.where(), f", set aside {len(gone)} units beyond E={self._deferred['end']}"
                        if gone else "")
            return

    def holds_job(self) -> bool:
        return self._ready if self.lists else self.uploader.allowed

    def allow_writes(self) -> None:
        self.uploader.allow()

    def record_config(self, fingerprint_id: str, fingerprint: dict) -> None:
        """Rank 0 records the fingerprint once; if Tier-3 is down now, a later restore can still refuse a
        changed config, only without naming the keys."""
        if not fingerprint_id or not self.lists:
            return
        if not self._ready:
            self._deferred["config"] = (fingerprint_id, dict(fingerprint))
            return
        self._record_config(fingerprint_id, fingerprint)

    def _record_config(self, fingerprint_id: str, fingerprint: dict) -> None:
        try:
            self.store.put(f"{FINGERPRINTS}{fingerprint_id}.json", json.dumps(fingerprint, sort_keys=True).encode())
        except StoreError as e:
            log.warning("could not record the config fingerprint on Tier-3 (%s): %s", self.store.url, e)

    def record_restores(self, history: list[dict]) -> None:
        """Rank 0 keeps the history on Tier-3 too, so that it survives every node; not while Tier-3 is offline."""
        if not self.lists or not self._ready:
            return
        try:
            write_history(self.store, RESTORES, history)
        except StoreError as e:
            log.warning("could not keep the restore history on Tier-3 (%s): %s", self.store.url, e)

    def point(self) -> Optional[int]:
        """The rack recovery point (known on rank 0), asked at each watermark sync; stops the run if another
        launch took the Tier-3 lease over. (The coordinator polls when rank 0's uploader marks a unit done.)"""
        if self.lease is not None and self.lease.lost is not None:
            raise LeaseHeld(f"this run lost the Tier-3 lease at {self.store.url}: {self.lease.lost}; it stops "
                            f"so that two runs never write one job's checkpoints")
        return self.coordinator.recovery_point()

    def durable_base(self) -> Optional[int]:
        return self.coordinator.newest_base()

    def reclaim(self, watermark: Optional[int]) -> None:
        if watermark is not None:
            self.coordinator.set_watermark(watermark)

    def degraded(self) -> Optional[str]:
        if not self.holds_job():
            return (f"{self.where()} has not answered since the launch ({self.offline or 'see rank 0'}); its "
                    f"uploads wait ({len(self.uploader.status().pending)} units queued)")
        failing = self.uploader.failing_for()
        if failing is not None:
            return f"{self.where()} failing for {failing:.0f} s: {self.uploader.status().last_error}"
        if self.coordinator.last_error is not None:
            return f"{self.where()}: commits failing: {self.coordinator.last_error}"
        return None

    def pending_bytes(self) -> int:
        return self.uploader.status().pending_bytes

    def metrics(self) -> dict:
        upload = self.uploader.base_upload_s
        return {} if upload is None else {"t3_base_upload_s": upload}

    def lag_cause(self) -> Optional[str]:
        status = self.uploader.status()
        if status.last_error:
            return f"Tier-3 ({self.store.url}) is failing: {status.last_error}"
        if status.pending:
            return f"Tier-3 uploads are slower than the save rate ({len(status.pending)} units queued)"
        return None

    def _remaining(self, timeout: float) -> float:
        """Seconds left of the exit's Tier-3 time (``checkpoint.remote.drain_timeout_s`` for drain and close
        together), counted from the first call."""
        if self._deadline is None:
            self._deadline = time.monotonic() + min(timeout, self.drain_timeout_s)
        return max(0.0, self._deadline - time.monotonic())

    def drain(self, step: int, timeout: float) -> None:
        """Upload what is queued until the exit's Tier-3 time is up, then stop."""
        self._left = self.uploader.close(self._remaining(timeout))
        if self._left:
            log.warning("rank %d: %d units not uploaded to Tier-3 at exit: %s", self.uploader.rank, len(self._left),
                        ", ".join(map(str, self._left)))

    def close(self, timeout: float) -> None:
        left = self._remaining(timeout)
        self._stop.set()
        if self._ready:
            self.coordinator.close(left)
        if self.lease is not None and self.lease.held is not None:
            self.lease.release()

    def abort(self, timeout: float) -> None:
        """Upload what is queued for a little while (no rank waits for it), commit what completed, give the
        lease back: the re-formed job takes it again."""
        self.drain(0, min(timeout, 2.0))
        self.close(timeout)

    def behind(self) -> int:
        return len(self._left)

    # ---- recovery ----------------------------------------------------------------------------

    def quarantine(self, pid: PayloadId, reason: str) -> Optional[str]:
        keys = list(self.store.list(f"{pid.dirname}/"))
        if not keys:
            return None
        when = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        dest = set_aside(self.store, pid, keys, reason, when)
        log.warning("Tier-3 %s failed its checksum and was quarantined to %s: %s", pid, self.store.describe(dest),
                    reason)
        return dest

    def repair(self, payload: EncodedPayload) -> None:
        self.uploader.submit(payload)

    def settle(self) -> None:
        """Commit what the previous launch left with every marker in but no ``_COMMITTED`` (its coordinator
        died first), so the inventory sees the same Tier-3 whenever it runs. A unit that cannot be committed
        stays uncommitted: never loaded, and cleaned up if it lies beyond the recovery point."""
        if self._ready:
            self._settle()

    def _settle(self) -> None:
        try:
            Committer(self.store, self.job_id).commit_pending(self.world_size)
        except (CommitError, StoreError) as e:
            log.warning("Tier-3 at %s: pending units left uncommitted before recovery: %s", self.store.url, e)

    def discard_after(self, end: int) -> list[str]:
        """Clean up after the restore to ``end`` (see :meth:`_discard_after`); offline, once Tier-3 answers."""
        if not self._ready:
            self._deferred["end"] = end
            return []
        return self._discard_after(end)

    def _discard_after(self, end: int) -> list[str]:
        """Delete uncommitted units after ``end`` (crashed attempts), and set committed ones aside.

        A committed unit beyond the recovery point is unreachable (a gap or a corrupt unit lies before it), and
        it belongs to an earlier incarnation whose future the resumed run replaces: were it kept, its
        ``_COMMITTED`` would block the resumed run's own unit of the same steps, and a later restore could chain
        one incarnation's units after another's. So it moves to ``_superseded/`` (kept for inspection, never
        offered again), and the lineage of every chain stays one run's."""
        units = list_units(self.store)
        beyond = beyond_end(units, end)
        doomed = {pid for pid in beyond if not units[pid].committed}
        gone = delete_units(doomed, lambda pid: delete_unit(self.store, list(units[pid].objects)))
        when = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        for pid in sorted(beyond - doomed, key=lambda p: (p.last, p.kind)):
            dest = set_aside(self.store, pid, list(units[pid].objects),
                             f"{pid} was committed beyond the recovery point E={end} of a later launch", when,
                             area=SUPERSEDED)
            log.warning("Tier-3 %s lies beyond the recovery point E=%d: set aside to %s", pid, end,
                        self.store.describe(dest))
        return [f"Tier-3 {pid}" for pid in gone] + [f"Tier-3 {pid} (superseded)" for pid in beyond - doomed]
