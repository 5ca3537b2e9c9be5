"""SaveWorker: the differential and base streams, serialized off the training loop's critical path.

The loop hands over, per step, the compressed record of the gradient shard the
optimizer consumed (the loop compresses it: see CheckpointManager.after_step)
and, every base interval, a snapshot of the shard (copied by the loop, so
training may overwrite the live state at once). The worker then, in
submission order:

- appends each step's record to the open diff batch; a closed batch is
  serialized as one payload (the step units that make each record durable at
  once are the loop's: see CheckpointManager.after_step);
- serializes each base once;
- has the first tier serialize the payload (Tier-1 writes it straight into
  its file in node memory and hands back a read-only map of that file), then
  puts the same bytes into every other tier that takes units from this thread;
- keeps the payload for the loop when a lockstep tier (Tier-2) will take it
  from the loop's thread (:meth:`take`);
- runs the tiers' reclamation when the loop's watermark sync asks for it
  (:meth:`submit_reclaim`).

Order matters for correctness: a unit reaches the first tier before any other,
and units are produced in step order, so every tier's recovery point only
moves forward.

``inline=True`` does the work in the caller's thread instead (tests of the
policy with in-memory tiers, no threads).
"""
from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from megatier.checkpoint.format.finite import NonFiniteState, nonfinite
from megatier.checkpoint.format.payload import (
    BaseState,
    DiffStep,
    EncodedPayload,
    PayloadDraft,
    draft_base,
    draft_diff_batch,
)
from megatier.checkpoint.format.units import BASE, DIFF, PayloadId
from megatier.checkpoint.save.capture import Reconcile
from megatier.checkpoint.threads import helper_thread
from megatier.checkpoint.tiers.base import Tier
from megatier.parallel.layout import Layout


@dataclass
class _DiffJob:
    record: Optional[DiffStep]  # None: only close the open batch
    close_batch: bool


@dataclass
class _ReclaimJob:
    watermark: Optional[int]
    tiers: Sequence[Tier]


class SaveWorker:
    """One rank's save thread; errors surface on the next call from the loop."""

    def __init__(self, *, job_id: str, layout: Layout, tiers: Sequence[Tier], keep_for_loop: bool,
                 fingerprint: str = "", inline: bool = False):
        if not tiers:
            raise ValueError("the save worker needs at least one tier")
        self.job_id, self.layout, self.fingerprint = job_id, layout, fingerprint
        self.tiers = list(tiers)
        self.keep_for_loop = keep_for_loop
        self._cv = threading.Condition()
        self._jobs: collections.deque = collections.deque()
        self._queued_bytes = 0
        self._ready: dict[PayloadId, EncodedPayload] = {}
        self._open: list[DiffStep] = []
        self._error: Optional[BaseException] = None
        # Every tier's metrics after the newest reclaim job (Tier.metrics; replaced whole, read by the loop).
        self.tier_metrics: dict = {}
        self._closing = False
        # Counters read by the loop for metrics.
        self.diff_bytes = 0  # compressed record bytes produced so far
        self.base_bytes = 0  # base payload bytes produced so far
        self.base_seconds: list[float] = []  # this thread's time to encode and store each base (base_interval=auto)
        self._diffs_through = -1  # the last step of the newest diff batch stored (in order, so all before it too)
        self._thread = None if inline else helper_thread(self._run, f"megatier-save-rank{layout.rank}")
        if self._thread is not None:
            self._thread.start()

    # ---- called by the loop -----------------------------------------------------------------

    def submit_diff(self, record: DiffStep, nbytes: int, close_batch: bool) -> None:
        """Append one step's compressed record (``nbytes`` of tensors) to the open batch; maybe close it."""
        with self._cv:
            self.diff_bytes += nbytes
        self._put(_DiffJob(record, close_batch), nbytes)

    def submit_close_batch(self) -> None:
        """Close the open diff batch now (at exit: its steps become a shorter batch); nothing if none is open."""
        self._put(_DiffJob(None, True), 0)

    def submit_base(self, state: Union[BaseState, Reconcile]) -> None:
        """A base to serialize: a snapshot, or a spread capture's parts that this thread reconciles first."""
        if isinstance(state, Reconcile):
            self._put(state, state.nbytes)
        else:
            self._put(state, 3 * state.master.numel() * state.master.element_size())

    def submit_reclaim(self, watermark: Optional[int], tiers: Sequence[Tier]) -> None:
        """Have ``tiers`` reclaim what is behind ``watermark`` once everything submitted before is stored.

        Deleting a base and its chain from node memory takes tens of milliseconds, so it runs here, beside
        training. In submission order, so a tier never reclaims against units it has not been given yet.
        Then the tiers' metrics are taken here too (:attr:`tier_metrics`): node memory's bytes held walks its
        directory, milliseconds the loop would pay at every batch end."""
        self._put(_ReclaimJob(watermark, tuple(tiers)), 0)

    def take(self, pid: PayloadId, timeout: float) -> EncodedPayload:
        """The finished payload of ``pid`` (waiting for it), removed from what this worker holds."""
        with self._cv:
            if not self._cv.wait_for(lambda: pid in self._ready or self._error is not None, timeout):
                raise TimeoutError(f"rank {self.layout.rank}: {pid} was not serialized within {timeout:.0f} s; the "
                                   f"save thread is stuck (CPU starved or a tier write hangs)")
            self._raise_if_failed()
            return self._ready.pop(pid)

    def wait_stored(self, pid: PayloadId, timeout: float) -> None:
        """Wait until the diff batch ``pid`` (and so every unit submitted before it) is stored in the tiers."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._diffs_through >= pid.last or self._error is not None, timeout):
                raise TimeoutError(f"rank {self.layout.rank}: {pid} was not stored within {timeout:.0f} s; the save "
                                   f"thread is stuck (CPU starved or a tier write hangs)")
            self._raise_if_failed()

    @property
    def pending_bytes(self) -> int:
        """Host bytes this worker holds: queued gradients and snapshots, payloads awaiting the loop."""
        with self._cv:
            return self._queued_bytes + sum(p.stamp.size for p in self._ready.values())

    def flush(self, timeout: float) -> None:
        """Wait until every submitted job is serialized and saved."""
        with self._cv:
            if not self._cv.wait_for(lambda: not self._jobs or self._error is not None, timeout):
                raise TimeoutError(f"rank {self.layout.rank}: the save thread did not drain within {timeout:.0f} s")
            self._raise_if_failed()

    def close(self, timeout: float) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the work -----------------------------------------------------------------------------

    def _put(self, job, nbytes: int) -> None:
        with self._cv:
            self._raise_if_failed()
            self._jobs.append((job, nbytes))
            self._queued_bytes += nbytes
            self._cv.notify_all()
        if self._thread is None:
            self._work_one()

    def _raise_if_failed(self) -> None:
        if isinstance(self._error, NonFiniteState):
            raise self._error
        if self._error is not None:
            raise RuntimeError(f"rank {self.layout.rank}: checkpoint save thread failed: {self._error!r}"
                               ) from self._error

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._jobs or self._closing)
                if not self._jobs:
                    return
            if not self._work_one():
                return

    def _work_one(self) -> bool:
        """Serialize and store the oldest job; False (and the error kept for the loop) if that failed."""
        with self._cv:
            job, nbytes = self._jobs[0]
        try:
            if isinstance(job, _ReclaimJob):
                for tier in job.tiers:
                    tier.reclaim(job.watermark)
                self.tier_metrics = {k: v for tier in job.tiers for k, v in tier.metrics().items()}
                draft = None
            else:
                start = time.perf_counter()
                draft = self._diff(job) if isinstance(job, _DiffJob) else self._base(job)
            payload = self._store(draft) if draft is not None else None
            if draft is not None and draft.pid.kind == BASE:
                self.base_seconds.append(time.perf_counter() - start)
        except BaseException as e:  # keep the cause for the loop; stop saving (nothing half-visible)
            with self._cv:
                self._error = e
                self._jobs.clear()
                self._cv.notify_all()
            if self._thread is None:
                self._raise_if_failed()
            return False
        with self._cv:
            self._jobs.popleft()
            self._queued_bytes -= nbytes
            if payload is not None and self.keep_for_loop:
                self._ready[payload.stamp.pid] = payload
            if payload is not None and payload.stamp.pid.kind == DIFF:
                self._diffs_through = max(self._diffs_through, payload.stamp.pid.last)
            self._cv.notify_all()
        return True

    def _diff(self, job: _DiffJob) -> Optional[PayloadDraft]:
        if job.record is not None:
            self._open.append(job.record)
        if not job.close_batch or not self._open:
            return None
        batch, self._open = self._open, []
        return draft_diff_batch(batch, job_id=self.job_id, layout=self.layout, fingerprint=self.fingerprint)

    def _base(self, state: Union[BaseState, Reconcile]) -> PayloadDraft:
        if isinstance(state, Reconcile):
            state = state.result()
        bad = nonfinite({name: getattr(state, name) for name in ("master", "exp_avg", "exp_avg_sq")})
        if bad:  # never a recovery point (megatier.checkpoint.format.finite)
            raise NonFiniteState(f"rank {self.layout.rank}: the training state at step {state.version} holds NaN "
                                 f"or inf in {', '.join(bad)}; its base was not stored, the checkpoints end before "
                                 f"it. Relaunch to restore the last finite state")
        return draft_base(state, job_id=self.job_id, layout=self.layout, fingerprint=self.fingerprint)

    def _store(self, draft: PayloadDraft) -> EncodedPayload:
        """Serialize once, into the first tier, and offer the same bytes to the others."""
        first, *rest = self.tiers
        payload = first.put_draft(draft)
        if draft.pid.kind == BASE:
            with self._cv:
                self.base_bytes += payload.stamp.size
        for tier in rest:
            tier.put(payload)
        return payload
