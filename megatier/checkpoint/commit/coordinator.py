"""The coordinator: global rank 0's background thread for Tier-3 phase 2 and Tier-3 reclamation.

Commits and reclamation run in this one thread so a unit is never committed
while its objects are being deleted (see :class:`~megatier.checkpoint.commit.committer.Committer`).
The thread polls the store: it commits every unit whose done markers are all
in, then, once the training loop has published a higher watermark, deletes
what the watermark made obsolete. Store failures are logged and retried on the
next poll; the loop never waits on this thread except at :meth:`close`.

When to poll: a unit can commit only once every rank's marker is in, global
rank 0's among them, and this thread runs on global rank 0. So rank 0's
uploader nudges the thread after each of its markers, naming the unit
(:meth:`nudge`); a unit found still waiting for other ranks' markers is
*awaited*, and while any is, the thread also polls every ``poll_s`` seconds.
Otherwise it sleeps until the next nudge or a higher watermark: a poll costs
listings of the store, and a poll that finds nothing new is CPU taken from the
training loop's cores.

What a poll reads: the two unit folders one level deep, then only the units
not yet known committed (a committed unit changes only when this thread
reclaims it), not every object of the job, however many units Tier-3 keeps.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Optional

from megatier.checkpoint.commit.committer import Committer
from megatier.checkpoint.commit.records import (
    UnitListing,
    delete_unit,
    list_unit,
    list_units,
    set_aside_units,
    unit_ids,
)
from megatier.checkpoint.format.chain import chain_end
from megatier.checkpoint.format.units import BASE, PayloadId
from megatier.checkpoint.reclaim.executor import delete_units
from megatier.checkpoint.reclaim.policy import remote_reclaim_set
from megatier.checkpoint.storage.store import ObjectStore, StoreError
from megatier.checkpoint.threads import helper_thread
from megatier.faults import CrashPoint, FaultHook, no_faults

log = logging.getLogger(__name__)
# Up to this many units unknown to a poll are listed one by one; more, and the poll lists the whole job once.
_LISTED_ONE_BY_ONE = 8


def reclaim_remote(store: ObjectStore, watermark: int, keep_bases: int) -> list[PayloadId]:
    """Delete the Tier-3 units ``watermark`` made obsolete (run in the thread that commits, so a unit is
    never committed while its objects go). Lists anew: units committed this round carry a commit record,
    which must go first. Units set aside (quarantined, superseded) are kept for inspection until the
    watermark passes them, so those areas stay bounded however many relaunches a run goes through."""
    units = list_units(store)
    doomed = remote_reclaim_set({p: u.committed for p, u in units.items()}, watermark, keep_bases)
    gone = delete_units(doomed, lambda pid: delete_unit(store, list(units[pid].objects)))
    for pid, keys in set_aside_units(store).items():
        if pid.last < watermark:
            for key in keys:
                store.delete(key)
    return gone


class Coordinator:
    """Commits complete units on Tier-3 and reclaims behind the watermark (rank 0 only)."""

    def __init__(self, store: ObjectStore, job_id: str, world_size: int, *, keep_bases: int,
                 fault_hook: FaultHook = no_faults, poll_s: float = 1.0):
        self.store = store
        self.world_size = world_size
        self.keep_bases = keep_bases
        self.fault_hook = fault_hook
        self.poll_s = poll_s
        self._committer = Committer(store, job_id, fault_hook=fault_hook)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._bases: set[int] = set()
        self._diffs: set[PayloadId] = set()
        self._watermark: Optional[int] = None
        self._reclaimed_at: Optional[int] = None
        self._awaited: set[PayloadId] = set()  # nudged units not yet committed: poll every poll_s until they are
        self._committed: dict[PayloadId, UnitListing] = {}  # units seen committed, not listed again
        self._failed = False  # the last poll failed: poll again every poll_s
        self.last_error: Optional[str] = None
        self._reported_at = 0.0
        self._thread = helper_thread(self._run, "megatier-t3-coordinator")

    def start(self) -> "Coordinator":
        """Start polling (after restore: recovery decides from a Tier-3 nobody is committing to)."""
        self._thread.start()
        return self

    # ---- what the loop reads -----------------------------------------------------------------

    def newest_base(self) -> Optional[int]:
        """Newest committed base this thread has seen (or written)."""
        with self._lock:
            return max(self._bases) if self._bases else None

    def recovery_point(self) -> Optional[int]:
        """The step a rack failure would recover to now: committed base + committed contiguous diffs."""
        with self._lock:
            return chain_end(self._bases, self._diffs)

    def set_watermark(self, watermark: int) -> None:
        """Publish a watermark every rank has learned; reclamation follows at once if it is higher."""
        with self._lock:
            if self._watermark is not None and watermark <= self._watermark:
                return
            self._watermark = watermark
        self._wake.set()

    def nudge(self, pid: Optional[PayloadId] = None) -> None:
        """Poll now. ``pid``: a unit this rank's uploader has just marked done; polls go on every ``poll_s``
        until it is committed (the other ranks' markers may still be on their way)."""
        if pid is not None:
            with self._lock:
                self._awaited.add(pid)
        self._wake.set()

    def _poll_due(self) -> bool:
        """Whether a poll without a nudge can find anything to do: a unit awaited, a failed poll to retry, a
        watermark not reclaimed yet (its base was not committed at the last poll)."""
        with self._lock:
            return bool(self._awaited) or self._failed or (
                self._watermark is not None and self._watermark != self._reclaimed_at)

    # ---- the thread ---------------------------------------------------------------------------

    def _units(self) -> dict[PayloadId, UnitListing]:
        """Every unit on Tier-3 with its listing: those known committed from memory, the rest listed now. A unit
        this rank's uploader marked again (a repair after a quarantine) is listed again too.

        Unknown units are listed one by one while they are few (a poll's usual case: the batch just uploaded),
        and with one listing of the whole job when many are (a launch's first poll knows none): one request per
        unit there would keep a launch that dies seconds after its restore from ever reaching the reclamation,
        and what it leaves makes the next launch's first poll longer still."""
        present = unit_ids(self.store)
        with self._lock:
            fresh = set(self._awaited)
        self._committed = {pid: u for pid, u in self._committed.items() if pid in present and pid not in fresh}
        unknown = [pid for pid in present if pid not in self._committed]
        if len(unknown) > _LISTED_ONE_BY_ONE:
            listed = list_units(self.store)
            looked_up = {pid: listed.get(pid, UnitListing()) for pid in unknown}
        else:
            looked_up = {pid: list_unit(self.store, pid) for pid in unknown}
        return {pid: looked_up[pid] if pid in looked_up else self._committed[pid] for pid in present}

    def poll_once(self) -> None:
        """One round: learn what is committed, commit what is complete, reclaim if the watermark moved."""
        units = self._units()
        for record in self._committer.commit_pending(self.world_size, units):
            self.fault_hook(CrashPoint.T3_AFTER_COMMIT, record.pid.version)
        self._committed.update((pid, u) for pid, u in units.items() if u.committed)
        bases = {p.version for p, u in units.items() if u.committed and p.kind == BASE}
        diffs = {p for p, u in units.items() if u.committed and p.kind != BASE}
        with self._lock:
            self._bases, self._diffs = bases, diffs
            self._awaited = {p for p in self._awaited if not (p in units and units[p].committed)}
            watermark = self._watermark
        if watermark is not None and watermark != self._reclaimed_at and watermark in bases:
            doomed = reclaim_remote(self.store, watermark, self.keep_bases)
            if doomed:
                log.info("Tier-3 reclaimed %d units behind watermark %d", len(doomed), watermark)
            self._reclaimed_at = watermark

    def _report(self, message: str, error: str, level: int = logging.WARNING) -> None:
        """Log a failure when it is new, and at most once a minute while it lasts (a store outage at debug
        level: the manager says it once per outage, from :meth:`RemoteTier.degraded`)."""
        now = time.monotonic()
        if error != self.last_error or now - self._reported_at > 60.0:
            log.log(level, "%s", message)
            self._reported_at = now
        self.last_error = error

    def _run(self) -> None:
        due = True  # the first poll learns what restore left committed
        while not self._stop.is_set():
            if due:
                self._poll_reporting()
            nudged = self._wake.wait(self.poll_s)
            self._wake.clear()
            due = nudged or self._poll_due()

    def _poll_reporting(self) -> None:
        failed = True
        try:
            self.poll_once()
            self.last_error, failed = None, False
        except StoreError as e:
            self._report(f"Tier-3 commit/reclaim at {self.store.url} failed, retrying: {e}", str(e), logging.DEBUG)
        except Exception as e:  # a corrupt marker from another job, etc.: keep training, say why
            self._report(f"Tier-3 coordinator error (commits paused until it clears): {e!r}", repr(e))
        with self._lock:
            self._failed = failed

    def close(self, timeout: float = 30.0) -> None:
        """Stop the thread, then commit once more so units completed at the end are not left pending; all of it
        within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        self._stop.set()
        self._wake.set()
        if self._thread.ident is None:
            return  # never started: this launch committed nothing
        self._thread.join(max(1.0, deadline - time.monotonic()))  # an idle thread ends at once
        if self._thread.is_alive():  # stuck in a store call: a second committer must not race it
            log.warning("final Tier-3 commit skipped: the coordinator is still waiting on %s", self.store.url)
            return
        while True:
            try:
                self.poll_once()
                return
            except StoreError as e:
                if time.monotonic() + 0.5 > deadline:
                    log.warning("final Tier-3 commit failed, units stay uncommitted: %s", e)
                    return
                time.sleep(0.5)


class NoCoordinator:
    """What every rank but global rank 0 holds in the coordinator's place: it commits nothing and
    knows no Tier-3 recovery point (rank 0's figures reach everyone through the watermark sync)."""

    last_error: Optional[str] = None

    def start(self) -> "NoCoordinator":
        return self

    def newest_base(self) -> Optional[int]:
        return None

    def recovery_point(self) -> Optional[int]:
        return None

    def set_watermark(self, watermark: int) -> None:
        pass

    def nudge(self, pid: Optional[PayloadId] = None) -> None:
        pass

    def close(self, timeout: float = 30.0) -> None:
        pass
