"""Spread base capture: a base copied in k parts over the k steps that end at its version, reconciled by replay.

``checkpoint.base_capture=snapshot`` copies the whole optimizer shard (fp32
master, exp_avg, exp_avg_sq: 12 bytes per parameter) in the loop at the base
step. With ``spread`` and ``checkpoint.capture_steps`` = k (GoCkpt's
multi-step capture; GoCkpt, arXiv:2511.07035, section 3), the base of version B is copied in k
contiguous parts of the flat shard, part j right after optimizer step
B - k + 1 + j, so each step copies 1/k of it:

    part j holds the state of its range at step s_j = B - k + 1 + j
    steps s_j + 1 .. B then update that range in training; their exact gradient
    slices (with lr, Adam step count, skipped flag) are kept for it
    at step B (the last part), every earlier part is brought to version B with
    ``adamw_replay``: the same kernel and per-element float operations as the
    training step, so the assembled base is bitwise the snapshot at B; the
    replay runs on the save thread (:class:`Reconcile`), not in the loop

The scalars (Adam step count, LR schedule, loss scaler, data position) are
those of version B, taken with the last part. The base exists only once the
last part is in: a failure inside the window leaves the previous base the
newest one. Bytes held meanwhile: the parts copied so far plus the kept
gradient slices (at most about 1.5 shards' worth of fp32 for any k); with a
schedule and node memory (``stage``), each finished part but the last is
written there by the copier thread and dropped from the process, which then
holds the part being copied and the gradient slices only, and the save thread
reads the parts back into the base's own tensors as it reconciles them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from megatier import ops
from megatier.checkpoint.format.payload import BaseState
from megatier.checkpoint.save.step_ops import Copier, ScheduledCopy
from megatier.checkpoint.shard import ShardAccess
from megatier.checkpoint.storage.directory import PartialFile
from megatier.checkpoint.storage.spare import SparePool
from megatier.checkpoint.tiers.node_memory import CaptureArea

STATE = ("master", "exp_avg", "exp_avg_sq")


def part_bounds(numel: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous [start, end) ranges tiling [0, numel), as equal as integers allow."""
    return [(numel * j // parts, numel * (j + 1) // parts) for j in range(parts)]


def clip_ranges(ranges: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """(k, 2) [start, end) ranges cut to [lo, hi) and shifted to start at lo; empty ones dropped."""
    out = [(max(a, lo) - lo, min(b, hi) - lo) for a, b in ranges.reshape(-1, 2).tolist() if min(b, hi) > max(a, lo)]
    return torch.tensor(out, dtype=torch.int64).reshape(-1, 2)


@dataclass
class _Part:
    lo: int
    hi: int
    state: Optional[dict[str, torch.Tensor]]  # kind -> (hi - lo,) fp32, the range at its step; None: staged
    grads: list[Optional[torch.Tensor]] = field(default_factory=list)  # later steps' gradient slices (None: skipped)
    steps: list[int] = field(default_factory=list)  # their Adam step counts
    lrs: list[float] = field(default_factory=list)
    skipped: list[bool] = field(default_factory=list)
    staged: Optional[str] = None  # the file holding ``state`` (master, exp_avg, exp_avg_sq in order) once written
    _spares: Optional[SparePool] = None  # where its file goes once read back

    @property
    def state_bytes(self) -> int:
        """Bytes of its state in this process (0 once staged)."""
        state = self.state
        return sum(t.numel() * 4 for t in state.values()) if state is not None else 0

    def stage(self, path: str, spares: SparePool) -> None:
        """Write the state to ``path`` (over a spare file of an earlier part if there is one) and let it go (on
        the copier thread, after the part's copy)."""
        state = self.state
        partial = PartialFile(path, fsync=False, reuse=spares.take(self.state_bytes))
        try:
            for kind in STATE:  # each large write goes to the file directly, with the GIL released
                partial.append(memoryview(state[kind].numpy()).cast("B"))
            os.replace(partial.seal(), path)
        except BaseException:
            partial.discard()
            raise
        self.staged, self._spares = path, spares
        self.state = None

    def load_into(self, out: dict[str, torch.Tensor]) -> None:
        """Its state into ``out[kind][lo:hi]``, from memory or from its file (which is then removed)."""
        if self.state is not None:
            for kind in STATE:
                out[kind][self.lo:self.hi].copy_(self.state[kind])
            return
        n = self.hi - self.lo
        with open(self.staged, "rb") as f:
            for kind in STATE:
                view = out[kind][self.lo:self.hi].numpy()
                if f.readinto(memoryview(view).cast("B")) != n * 4:
                    raise OSError(f"staged capture part {self.staged} is short")
        if not self._spares.give(self.staged):  # read: its pages can take the next capture's part
            os.remove(self.staged)


class SpreadCapture:
    """One base of version ``version`` being captured over steps version - k + 1 .. version.

    ``schedule_part(lo, hi)``, when given, returns a :class:`~.step_ops.ScheduledCopy` of the range that the
    *next* step copies during its operations (the state does not change before that step's update): part j
    then holds version ``first + j`` and is complete at the following after_step, and the base one step after
    its version. Without it each part is copied at once, at the end of its step.
    """

    def __init__(self, shard: ShardAccess, version: int, parts: int,
                 schedule_part: Optional[Callable[[int, int], ScheduledCopy]] = None, copier: Optional[Copier] = None,
                 stage: Optional[CaptureArea] = None):
        if parts < 1:
            raise ValueError(f"a spread capture needs at least one part, got {parts}")
        self.shard, self.version, self.k = shard, version, parts
        self.first = version - parts + 1
        self.bounds = part_bounds(shard.numel, parts)
        self.parts: list[_Part] = []
        self._schedule_part = schedule_part
        self._copier = copier  # with a schedule: keeps the gradient slices off the loop too (done by the next update)
        self._stage = stage if copier is not None else None  # where finished parts wait (node memory)
        self._pending: Optional[tuple[int, int, ScheduledCopy]] = None  # (lo, hi, its copy) during this step
        self._scalars: Optional[BaseState] = None

    @property
    def scheduled(self) -> bool:
        return self._schedule_part is not None

    @property
    def held_bytes(self) -> int:
        """Host bytes this capture holds: the parts copied so far (or being copied) and the kept gradient slices."""
        state = sum(p.state_bytes for p in self.parts)
        grads = sum(g.numel() * 4 for p in self.parts for g in p.grads if g is not None)
        pending = self._pending[2].held_bytes if self._pending is not None else 0
        return state + grads + pending

    def after_step(self, step: int) -> Optional["Reconcile"]:
        """Account for optimizer step ``step``: complete the part its operations copied, keep its gradient for
        the parts holding earlier versions, take (or schedule) part ``step - first``; the base to reconcile (on
        the save thread: :meth:`Reconcile.result`) once every part is in, else None."""
        if self._pending is not None:
            self._complete_pending(step)
        if step <= self.version:
            grad, lr, adam_step, skipped = self.shard.consumed()
            # One copy covers every part here (contiguous from the shard's start); each keeps its view of it.
            lo = self.parts[0].lo if self.parts else 0
            kept = None if skipped or not self.parts else self._keep(grad[lo:self.parts[-1].hi])
            for part in self.parts:  # every part here holds a version before ``step``
                part.grads.append(None if kept is None else kept[part.lo - lo:part.hi - lo])
                part.steps.append(adam_step)
                part.lrs.append(lr)
                part.skipped.append(skipped)
        if self.first <= step <= self.version:
            self._take_part(step - self.first)
        if step == self.version:  # the scalars (and the error-feedback reset) belong to this step
            self._scalars = self.shard.base_of(self.version, {k: torch.empty(0) for k in STATE})
        return self._result()

    def flush(self) -> Optional["Reconcile"]:
        """At exit: copy a scheduled part now (no update has run since its step); the base if that completes it."""
        if self._pending is not None:
            self._pending[2].finish()
            self._complete_pending(None)
        return self._result()

    def _keep(self, grad: torch.Tensor) -> torch.Tensor:
        """A host copy of a gradient slice: now, or by the copier (the gradient is never written again, and
        the next update, or :meth:`flush`, waits for the copy before the parts are used)."""
        if self._copier is None:
            return grad.to("cpu", copy=True)
        out = self._copier.host_buffer(grad.numel())
        self._copier.submit([(grad, out)])
        return out

    def _take_part(self, j: int) -> None:
        if j != len(self.parts):
            raise ValueError(f"spread capture of base v{self.version} over steps {self.first}..{self.version} "
                             f"got step {self.first + j} after {len(self.parts)} parts")
        lo, hi = self.bounds[j]
        if self._schedule_part is not None:
            self._pending = (lo, hi, self._schedule_part(lo, hi))
            return
        o = self.shard.optimizer
        self.parts.append(_Part(lo, hi, {k: getattr(o, k)[lo:hi].to("cpu", copy=True) for k in STATE}))

    def _complete_pending(self, step: Optional[int]) -> None:
        lo, hi, copy = self._pending
        if not copy.done:
            raise RuntimeError(f"spread capture of base v{self.version}: the part [{lo}, {hi}) scheduled for step "
                               f"{step} was not copied before its update")
        part = _Part(lo, hi, copy.destination)
        self.parts.append(part)
        self._pending = None
        if self._stage is not None and len(self.parts) < self.k:  # the last part is reconciled at once
            path = os.path.join(self._stage.directory, f"v{self.version:08d}-part{len(self.parts) - 1}")
            self._copier.call(lambda: part.stage(path, self._stage.spares))

    def _result(self) -> Optional["Reconcile"]:
        if len(self.parts) < self.k or self._scalars is None:
            return None
        o = self.shard.optimizer
        parts, self.parts = self.parts, []
        return Reconcile(self._scalars, parts, o.cfg, o.decay_ranges.clone())


@dataclass
class Reconcile:
    """A spread base whose earlier parts still have to be brought to its version: done by :meth:`result`, off the
    training loop (the save thread calls it before serializing)."""

    base: BaseState  # the scalars of the version; its state tensors are filled in by result()
    parts: list[_Part]
    optim: object  # OptimConfig: beta1, beta2, eps, weight_decay
    decay_ranges: torch.Tensor

    @property
    def version(self) -> int:
        return self.base.version

    @property
    def nbytes(self) -> int:
        return sum(p.state_bytes for p in self.parts)

    def result(self) -> BaseState:
        """Each part loaded into the base's tensors and replayed there to the base's version."""
        c = self.optim
        numel = self.parts[-1].hi
        out = {kind: torch.empty(numel, dtype=torch.float32) for kind in STATE}
        for part in self.parts:
            part.load_into(out)
            if part.steps:
                lo, hi = part.lo, part.hi
                ops.adamw_replay(out["master"][lo:hi], out["exp_avg"][lo:hi], out["exp_avg_sq"][lo:hi],
                                 part.grads, part.steps, part.lrs, c.beta1, c.beta2, c.eps, c.weight_decay,
                                 clip_ranges(self.decay_ranges, lo, hi), skipped=part.skipped)
        for kind in STATE:
            setattr(self.base, kind, out[kind])
        self.parts = []
        return self.base
