"""SaveWorker: the differential and base streams, serialized off the training loop's critical path.

The loop hands over, per step, the compressed record of the gradient shard the
optimizer consumed (the loop compresses it: see CheckpointManager.after_step)
and, every base interval, a snapshot of the shard (copied by the loop, so
training may overwrite the live state at once). This thread then, in
submission order:

- appends each step's record to the open diff batch; a closed batch is
  serialized as one payload;
- serializes each base once;
- serializes every payload straight into its Tier-1 file (the node's memory)
  and queues a read-only map of that file for Tier-3 and, until the loop takes
  it, for the Tier-2 hand-off: one copy of the tensors feeds all three tiers.

Order matters for correctness: a unit reaches Tier-1 before it is offered to
the other tiers, and units are produced in step order, so the Tier-1 recovery
point only moves forward.
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Optional

from megatier.checkpoint.commit.coordinator import chain_end
from megatier.checkpoint.tiers.node_memory import LocalTier
from megatier.checkpoint.format.units import BASE, PayloadId
from megatier.checkpoint.format.payload import (BaseState, DiffStep, EncodedPayload, PayloadDraft, ShardLayout, draft_base,
                                         draft_diff_batch)
from megatier.checkpoint.threads import helper_thread
from megatier.checkpoint.commit.uploader import Uploader


@dataclass
class _DiffJob:
    record: DiffStep
    close_batch: bool


class SaveWorker:
    """One rank's save thread; errors surface on the next call from the loop."""

    def __init__(self, *, job_id: str, layout: ShardLayout, local: Optional[LocalTier], uploader: Optional[Uploader],
                 keep_for_peer: bool):
        self.job_id = job_id
        self.layout = layout
        self.local = local
        self.uploader = uploader
        self.keep_for_peer = keep_for_peer
        self._cv = threading.Condition()
        self._jobs: collections.deque = collections.deque()
        self._queued_bytes = 0
        self._ready: dict[PayloadId, EncodedPayload] = {}
        self._open: list[DiffStep] = []
        self._error: Optional[BaseException] = None
        self._closing = False
        # Counters and the Tier-1 holdings, read by the loop for metrics and the recovery point.
        self.diff_bytes = 0  # compressed record bytes produced so far
        self.base_bytes = 0  # base payload bytes produced so far
        self.t1_bases: set[int] = set()
        self.t1_diffs: set[tuple[int, int]] = set()
        self._thread = helper_thread(self._run, f"megatier-save-rank{layout.rank}")
        self._thread.start()

    # ---- called by the loop -----------------------------------------------------------------

    def submit_diff(self, record: DiffStep, nbytes: int, close_batch: bool) -> None:
        """Append one step's compressed record (``nbytes`` of tensors) to the open batch; maybe close it."""
        with self._cv:
            self.diff_bytes += nbytes
        self._put(_DiffJob(record, close_batch), nbytes)

    def submit_base(self, state: BaseState) -> None:
        self._put(state, 3 * state.master.numel() * state.master.element_size())

    def take(self, pid: PayloadId, timeout: float) -> EncodedPayload:
        """The finished payload of ``pid`` (waiting for it), removed from what this worker holds."""
        with self._cv:
            if not self._cv.wait_for(lambda: pid in self._ready or self._error is not None, timeout):
                raise TimeoutError(f"rank {self.layout.rank}: {pid} was not serialized within {timeout:.0f} s; the "
                                   f"save thread is stuck (CPU starved or a tier write hangs)")
            self._raise_if_failed()
            return self._ready.pop(pid)

    @property
    def pending_bytes(self) -> int:
        """Host bytes this worker holds: queued gradients and snapshots, payloads awaiting Tier-2."""
        with self._cv:
            return self._queued_bytes + sum(p.stamp.size for p in self._ready.values())

    def t1_point(self) -> Optional[int]:
        """Newest step recoverable from this rank's Tier-1 holdings alone."""
        with self._cv:
            return chain_end(set(self.t1_bases), set(self.t1_diffs))

    def forget(self, pid: PayloadId) -> None:
        """Reclamation removed ``pid`` from Tier-1."""
        with self._cv:
            (self.t1_bases.discard(pid.version) if pid.kind == BASE else self.t1_diffs.discard((pid.first, pid.last)))

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
        self._thread.join(timeout)

    # ---- the thread ---------------------------------------------------------------------------

    def _put(self, job, nbytes: int) -> None:
        with self._cv:
            self._raise_if_failed()
            self._jobs.append((job, nbytes))
            self._queued_bytes += nbytes
            self._cv.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"rank {self.layout.rank}: checkpoint save thread failed: {self._error!r}") from self._error

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._jobs or self._closing)
                if not self._jobs:
                    return
                job, nbytes = self._jobs[0]
            try:
                draft = self._diff(job) if isinstance(job, _DiffJob) else self._base(job)
                payload = self._store(draft) if draft is not None else None
            except BaseException as e:  # keep the cause for the loop; stop saving (nothing half-visible)
                with self._cv:
                    self._error = e
                    self._jobs.clear()
                    self._cv.notify_all()
                return
            with self._cv:
                self._jobs.popleft()
                self._queued_bytes -= nbytes
                if payload is not None and self.keep_for_peer:
                    self._ready[payload.stamp.pid] = payload
                self._cv.notify_all()

    def _diff(self, job: _DiffJob) -> Optional[PayloadDraft]:
        self._open.append(job.record)
        if not job.close_batch:
            return None
        batch, self._open = self._open, []
        return draft_diff_batch(batch, job_id=self.job_id, layout=self.layout)

    def _base(self, state: BaseState) -> PayloadDraft:
        return draft_base(state, job_id=self.job_id, layout=self.layout)

    def _store(self, draft: PayloadDraft) -> EncodedPayload:
        """Serialize once (into Tier-1 when there is one) and offer the same bytes to Tier-3."""
        pid = draft.pid
        if self.local is not None:
            payload = self.local.save_draft(draft)
            with self._cv:
                (self.t1_bases.add(pid.version) if pid.kind == BASE else self.t1_diffs.add((pid.first, pid.last)))
        else:
            payload = draft.to_payload()
        if pid.kind == BASE:
            with self._cv:
                self.base_bytes += payload.stamp.size
        if self.uploader is not None:
            self.uploader.submit(payload)
        return payload
