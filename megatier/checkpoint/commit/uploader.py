"""Tier-3 phase 1: a background thread per rank that uploads payloads and writes done markers.

For each submitted payload, in submission order: upload the object, call the
``t3.before_marker`` fault point, then write the rank's done marker (see
:mod:`megatier.checkpoint.commit.records`). Store failures are retried with
exponential backoff and jitter for as long as the uploader is open: when Tier-3
is down, training goes on, the queue grows (``pending_bytes``; the caller
enforces its memory budget) and ``status()`` reports the last error.

An exception that is not a store failure (a bug, or a fault hook simulating a
crash) stops the worker; the unit it was on stays without a marker, so it is
never committed, and every later call raises :class:`UploaderError`.
"""
from __future__ import annotations

import collections
import logging
import random
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

from megatier.checkpoint.commit.records import DoneMarker, marker_key, object_key
from megatier.checkpoint.format.payload import EncodedPayload
from megatier.checkpoint.format.units import BASE, PayloadId
from megatier.checkpoint.storage.store import ObjectStore, RetryPolicy, StoreError
from megatier.checkpoint.threads import helper_thread
from megatier.faults import CrashPoint, FaultHook, no_faults

T = TypeVar("T")
log = logging.getLogger(__name__)


class UploaderError(RuntimeError):
    """The upload worker stopped on an unexpected error; the message names the rank and the cause."""


class _Stopped(Exception):
    """Raised inside the worker when close() abandons the current payload."""


@dataclass(frozen=True)
class UploaderStatus:
    """A snapshot for metrics and warnings (t3 lag, held bytes, failing remote)."""

    pending: tuple[PayloadId, ...]
    pending_bytes: int
    last_uploaded: Optional[PayloadId]
    failures: int
    last_error: Optional[str]


# Queued payloads kept as maps of their Tier-1 files (each holds file descriptors); later ones are copied.
MAPPED_QUEUE_CAP = 64


class Uploader:
    """Uploads rank ``rank``'s payloads to ``store`` in order; start with construction, end with close()."""

    def __init__(self, store: ObjectStore, job_id: str, rank: int, *, incarnation: str,
                 backoff: RetryPolicy = RetryPolicy(), fault_hook: FaultHook = no_faults,
                 on_done: Optional[Callable[[PayloadId], None]] = None, open_now: bool = True):
        # ``incarnation`` must be the same on every rank of one launch and differ between launches
        # (e.g. a token broadcast from rank 0 at start-up): a commit never mixes two incarnations' markers.
        # Only backoff's delays are used: the uploader never gives up on a payload while it is open.
        # ``on_done(pid)`` runs in the uploader's thread after each done marker (the coordinator's nudge).
        # ``open_now=False``: payloads queue until :meth:`allow` (a launch that started while Tier-3 was down
        # writes nothing before global rank 0 holds the job's lease and has cleaned up after the restore).
        if not incarnation:
            raise ValueError("incarnation must be a non-empty token shared by every rank of this launch")
        self.store, self.job_id, self.rank, self.incarnation = store, job_id, rank, incarnation
        self.backoff, self.fault_hook, self.on_done = backoff, fault_hook, on_done
        self._rng = random.Random()
        self._queue: collections.deque[EncodedPayload] = collections.deque()
        self._cv, self._abort = threading.Condition(), threading.Event()
        self._open = open_now
        self._closing = self._stopped = False  # _stopped: the worker thread has exited
        self._error: Optional[BaseException] = None
        self._last: Optional[PayloadId] = None
        self._failures, self._last_error = 0, None
        self._failing_since: Optional[float] = None  # first failure since the last success
        self._warned_at = 0.0
        self.skipped = 0  # queued units dropped because a newer base superseded them
        self.base_upload_s: Optional[float] = None  # the last base's upload and marker, seconds (retries included)
        self._thread = helper_thread(self._run, f"megatier-t3-upload-rank{rank}")
        self._thread.start()

    def submit(self, payload: EncodedPayload) -> None:
        """Queue ``payload`` (its bytes are held until uploaded); never blocks on Tier-3."""
        if payload.stamp.rank != self.rank or payload.stamp.job_id != self.job_id:
            raise ValueError(f"payload of rank {payload.stamp.rank} in job {payload.stamp.job_id!r} submitted "
                             f"to the uploader of rank {self.rank} in job {self.job_id!r}")
        with self._cv:
            self._raise_if_failed()
            if self._closing:
                self._refuse(payload.stamp.pid)
            if payload.mapped and len(self._queue) >= MAPPED_QUEUE_CAP:
                # Tier-3 is behind: queue a copy so a long outage holds memory (bounded by the
                # budget), not thousands of open files and maps of Tier-1.
                payload = payload.detached()
            if payload.stamp.pid.kind == BASE and self._failing_since is not None:
                self._supersede(payload)
            self._queue.append(payload)
            self._cv.notify_all()

    def allow(self) -> None:
        """Start uploading what is queued (see ``open_now``)."""
        with self._cv:
            self._open = True
            self._cv.notify_all()

    @property
    def allowed(self) -> bool:
        return self._open

    def failing_for(self) -> Optional[float]:
        """Seconds since the first failure after the last success; None while uploads succeed."""
        with self._cv:
            return None if self._failing_since is None else time.monotonic() - self._failing_since

    def _supersede(self, base: EncodedPayload) -> None:
        """While Tier-3 is failing, drop the queued units ``base`` makes pointless (older bases, diffs ending at or
        before it; never the one in flight): the backlog of an outage stays one base interval, not unbounded."""
        version = base.stamp.pid.version
        keep = [p for i, p in enumerate(self._queue) if i == 0 or p.stamp.pid.last > version]
        dropped = len(self._queue) - len(keep)
        if dropped:
            self._queue = collections.deque(keep)
            self.skipped += dropped
            log.info("rank %d: Tier-3 is behind; %d queued units superseded by %s are not uploaded", self.rank,
                     dropped, base.stamp.pid)

    def status(self) -> UploaderStatus:
        """Queue, held bytes, last uploaded unit and failures, for metrics and warnings."""
        with self._cv:
            return UploaderStatus(tuple(p.stamp.pid for p in self._queue), sum(p.stamp.size for p in self._queue),
                                  self._last, self._failures, self._last_error)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until every queued payload is uploaded and marked; False on timeout or after close()."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._queue and not self._stopped:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
            self._raise_if_failed()
            return not self._queue

    def close(self, timeout: Optional[float] = None) -> list[PayloadId]:
        """Drain for up to ``timeout`` seconds, then stop; returns the units left un-uploaded."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        try:
            self.wait(timeout)
        except UploaderError:
            pass  # close() reports what is left; the cause stays available through wait()/submit()
        self._abort.set()
        with self._cv:
            self._cv.notify_all()
        # A store call in flight ends at its own timeout; the thread is a daemon, so the exit does not wait.
        self._thread.join(timeout=1.0)
        with self._cv:
            return [p.stamp.pid for p in self._queue]

    def _refuse(self, pid: PayloadId) -> None:
        raise UploaderError(f"uploader of rank {self.rank} is closed; {pid} was not queued")

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise UploaderError(f"Tier-3 uploader of rank {self.rank} stopped: {self._error!r}") from self._error

    def _run(self) -> None:
        try:
            self._work()
        finally:
            with self._cv:
                self._stopped = True
                self._cv.notify_all()

    def _work(self) -> None:
        while True:
            with self._cv:
                while (not self._queue or not self._open) and not self._abort.is_set() and not (
                        self._closing and not self._queue):
                    self._cv.wait()
                if not self._queue or self._abort.is_set():
                    return
                payload = self._queue[0]
            try:
                self._upload(payload)
            except _Stopped:
                return
            except BaseException as e:  # a fault hook's simulated crash or a bug: stop, keep the cause
                with self._cv:
                    self._error = e
                    self._cv.notify_all()
                return
            with self._cv:
                self._queue.popleft()
                self._last = payload.stamp.pid
                self._cv.notify_all()

    def _upload(self, payload: EncodedPayload) -> None:
        stamp = payload.stamp
        key = object_key(stamp)
        start = time.perf_counter()
        self._persist(lambda: self.store.put_from(key, payload.data, payload.source),
                      f"uploading {stamp.pid} of rank {self.rank}")
        self.fault_hook(CrashPoint.T3_BEFORE_MARKER, stamp.pid.version)
        marker = DoneMarker(key, stamp, self.incarnation).to_json()
        self._persist(lambda: self.store.put(marker_key(stamp.pid, self.rank), marker),
                      f"writing the done marker of {stamp.pid} of rank {self.rank}")
        if stamp.pid.kind == BASE:
            self.base_upload_s = time.perf_counter() - start
        if self.on_done is not None:
            self.on_done(stamp.pid)

    def _persist(self, action: Callable[[], T], what: str) -> T:
        """Run ``action`` until it succeeds, backing off between store failures; _Stopped on close()."""
        attempt = 0
        while True:
            if self._abort.is_set():
                raise _Stopped()
            try:
                out = action()
                with self._cv:
                    self._failing_since = None
                return out
            except StoreError as e:
                now = time.monotonic()
                with self._cv:
                    self._failures += 1
                    self._last_error = f"{what}: {e}"
                    self._failing_since = self._failing_since or now
                if now - self._warned_at > 60.0:  # the console line per outage is the manager's (degraded)
                    self._warned_at = now
                    log.debug("Tier-3 %s failed (attempt %d), retrying: %s", what, attempt + 1, e)
                if self._abort.wait(self.backoff.delay(attempt, self._rng)):
                    raise _Stopped() from e
                attempt += 1
