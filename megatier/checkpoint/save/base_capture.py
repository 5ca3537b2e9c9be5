"""BaseCapturer: when and how this rank's bases leave the optimizer (``checkpoint.base_capture``).

* ``snapshot``: the whole shard copied in the loop at each base step (the reference);
* ``spread``: copied in ``capture_steps`` parts over the steps ending at the
  base's version, reconciled by replay on the save thread (:mod:`.capture`);
* ``spread`` with ``capture_schedule=checkflow``: one step (the second after
  the anchor) is profiled into operations (:mod:`.step_ops`), then the copy
  bandwidth is measured and a schedule solved once (:mod:`.schedule`) on the
  copier's thread while the loop trains on (tens of milliseconds of work the
  loop need not wait for); the schedule applies from the first
  capture after it is ready, which waits for it only if the solve has not
  finished by then. Each part is then copied during the next step's
  operations, off the training thread, and the base is complete one step after
  its version. When no schedule exists (before the profile, or the solver
  found none) parts are copied at the end of their step, and the base is
  still handed on one step after its version: whether the solver finds a
  schedule depends on each rank's own timings, and a rank handing its base to
  the lockstep tiers (Tier-2's ring) a step before the others would break the
  pairing of their transfers.

Bases are at the anchor (a snapshot, taken by the manager) and every
:attr:`BaseCapturer.interval` steps after it (``base_interval``, or the one
``auto`` chose); a capture never overlaps the next one (``capture_steps`` is
at most the interval).
"""
from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Optional, Union

from torch import nn

from megatier.checkpoint.format.payload import BaseState
from megatier.checkpoint.save.capture import STATE, Reconcile, SpreadCapture, part_bounds
from megatier.checkpoint.save.schedule import CaptureSchedule, OpProfile, plan
from megatier.checkpoint.save.step_ops import Copier, Profiler, ScheduledCopy, StepOps, copy_bandwidth
from megatier.checkpoint.shard import ShardAccess
from megatier.checkpoint.tiers.node_memory import CaptureArea
from megatier.config import CheckpointConfig

log = logging.getLogger(__name__)
BYTES_PER_ELEMENT = 4 * len(STATE)  # fp32 master, exp_avg, exp_avg_sq


class BaseCapturer:
    """The base capture of one rank; the manager calls :meth:`after_step` once per step."""

    def __init__(self, cfg: CheckpointConfig, shard: ShardAccess, model: Optional[nn.Module], *, rank: int,
                 stage: Optional[CaptureArea] = None):
        self.cfg, self.shard, self.rank = cfg, shard, rank
        self._stage = stage  # node memory for finished parts of a scheduled capture (None: keep them)
        self.anchor = 0
        # Steps between bases; None (base_interval=auto, before its decision): no base after the anchor yet.
        self.interval: Optional[int] = cfg.base_interval if cfg.base_interval != "auto" else None
        self.schedule: Optional[CaptureSchedule] = None
        self._capture: Optional[SpreadCapture] = None
        self._report: dict = {}
        scheduled = cfg.base_capture == "spread" and cfg.capture_schedule == "checkflow" and model is not None
        self._device = shard.optimizer.master.device
        self._ops = StepOps(model, shard.optimizer) if scheduled else None
        self._copier = Copier(self._device) if scheduled else None
        self._profiler: Optional[Profiler] = None
        self._planning: Optional[Future] = None  # the copier's solve: (schedule or None, the line to report)
        self._planned = not scheduled
        self._held: Optional[Reconcile] = None  # an unscheduled base, handed on at the step a scheduled one would be

    @property
    def held_bytes(self) -> int:
        held = self._held.nbytes if self._held is not None else 0
        return held + (self._capture.held_bytes if self._capture is not None else 0)

    def after_step(self, step: int) -> Optional[Union[BaseState, Reconcile]]:
        """The base to hand to the save thread after optimizer step ``step`` (a snapshot, or a spread capture's
        parts to reconcile), or None; also steps the profile and the capture in progress."""
        self._report = {}
        if self._ops is not None:
            self._ops.listener = None
        if self._copier is not None:
            self._copier.hold()  # until the manager's save path is done with the loop: :meth:`release`
        since, k = step - self.anchor, self.cfg.capture_steps
        spread = self.cfg.base_capture == "spread"
        starts = spread and self.interval is not None and (since + k - 1) % self.interval == 0  # a capture's part 0
        self._plan(step, needed=starts)
        if not spread:
            due = self.interval is not None and since % self.interval == 0
            return self._handed(self.shard.capture_base(step), "snapshot") if due else None
        base, how = None, "spread"
        if self._capture is not None:
            how = "scheduled" if self._capture.scheduled else "spread"
            base = self._capture.after_step(step)
            if base is not None:
                self._capture = None
        if starts:
            scheduled = self.schedule is not None
            self._capture = SpreadCapture(self.shard, step + k - 1, k, self._schedule_part if scheduled else None,
                                          self._copier if scheduled else None, self._stage)
            first = self._capture.after_step(step)  # part 0; a base already when k = 1 and it is copied now
            if first is not None:
                base, how, self._capture = first, "spread", None
        return self._handed(*self._on_schedule_step(base, how))

    def _on_schedule_step(self, base: Optional[Reconcile], how: str) -> tuple[Optional[Reconcile], str]:
        """With the Checkflow schedule configured every base is handed on one step after its version, as a
        scheduled capture completes: an unscheduled one (no profile yet, or no schedule found on this rank)
        is held for a step. At most one base completes per step (two captures never share a version), and no
        capture is under way while one is held (the next starts at least base_interval - k + 1 >= 1 steps
        after the held one's version)."""
        if self._ops is None or (base is not None and how == "scheduled"):
            return base, how
        held, self._held = self._held, base
        return held, "spread"

    def release(self) -> None:
        """Let the copier start what this step gave it (the part to stage, gradient slices, the planning)."""
        if self._copier is not None:
            self._copier.release()

    def flush(self) -> Optional[Reconcile]:
        """At exit: a capture whose version was reached but whose last part was to be copied by the next step."""
        base = self._held  # never beside a capture under way (see _on_schedule_step)
        if base is None and self._capture is not None:
            base = self._capture.flush()
        self._capture = self._held = None
        return base

    def metrics(self) -> dict:
        return {"ckpt_capture_bytes": self.held_bytes, **self._report}

    def close(self) -> None:
        if self._ops is not None:
            self._ops.close()
        if self._copier is not None:
            self._copier.close()

    # ---- internals -----------------------------------------------------------------------------

    def _handed(self, base, how: str):
        if base is not None:
            self._report.update(base_capture=how, base_capture_version=base.version)
        return base

    def _schedule_part(self, lo: int, hi: int) -> ScheduledCopy:
        o = self.shard.optimizer
        copy = ScheduledCopy({k: getattr(o, k)[lo:hi] for k in STATE}, self.schedule, self._copier)
        self._ops.listener = copy
        return copy

    def _plan(self, step: int, needed: bool) -> None:
        """Profile the second step after the anchor (the first pays warm-up), then have the copier solve the
        schedule once; take it when it is ready, or wait for it when a capture starts now (``needed``)."""
        if self._planned:
            return
        if self._profiler is None:
            if step > self.anchor:
                self._profiler = Profiler(self._device)
                self._ops.listener = self._profiler
            return
        if self._planning is None:
            profile = self._profiler.profile
            if profile is None:
                return
            self._planning = self._copier.call(lambda: self._solve(profile))
        if not (needed or self._planning.done()):
            return
        self._planned = True
        self._copier.release()  # a capture starts now: the planning given this step must run before it
        self.schedule, line = self._planning.result()
        self._report["base_capture_schedule"] = line.splitlines()[0]
        if self.rank == 0:
            log.info("%s", line)

    def _solve(self, profile: OpProfile) -> tuple[Optional[CaptureSchedule], str]:
        """On the copier's thread: the schedule for this profile at the measured bandwidth, and its description."""
        part = max(hi - lo for lo, hi in part_bounds(self.shard.numel, self.cfg.capture_steps))
        bandwidth = copy_bandwidth(self._copier)
        schedule = plan(profile, part, BYTES_PER_ELEMENT, bandwidth, held_on_device=self._device.type != "cuda")
        if schedule is not None:
            return schedule, schedule.describe(profile, BYTES_PER_ELEMENT)
        return None, (f"capture schedule: none fits ({len(profile.names)} ops in {profile.step_seconds * 1e3:.1f} "
                      f"ms, {part * BYTES_PER_ELEMENT / 2**20:.1f} MiB per part at {bandwidth / 2**30:.1f} GiB/s): "
                      f"each part is copied at the end of its step")
