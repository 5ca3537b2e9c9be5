"""Telling a transient fault from a real divergence by running a suspicious step again (``reliability.spike_factor``).

A bit flipped in one step's activations or gradients by faulty hardware (silent data corruption) looks like a
divergence: a loss or gradient norm far above the recent ones, or not finite at all. Training is deterministic
here (the drills compare whole runs bit for bit), so the same step computed again on the same batch with the
same dropout masks gives the same bits unless something went wrong on the way. Megatron-core's rerun state
machine has the same idea.

:class:`SpikeCheck` says which steps are suspicious: a non-finite loss or gradient norm (outside fp16, where an
overflow is the loss scaler's business) or one more than ``spike_factor`` times the median of the last
:data:`WINDOW` applied steps (from :data:`MIN_HISTORY` of them on). The trainer then runs the step's forward and
backward again before the optimizer applies anything, and :func:`ranks_that_differ` compares the two results:

- they differ on some rank: a transient fault. The second result is used and the event is logged with the step
  and the ranks;
- they are equal: the step is what it is. A non-finite one goes to ``reliability.on_nonfinite``
  (:mod:`.nonfinite`); a finite spike is trained on.

The decision is the same on every rank: the loss and the gradient norm it reads are all-reduced over the job,
and so is the comparison.
"""
from __future__ import annotations

import collections
import math
import statistics
from typing import Optional

import torch
import torch.distributed as dist

WINDOW = 50  # applied steps the median is taken over
MIN_HISTORY = 10  # no spike is called before this many


class SpikeCheck:
    """The running medians of the loss and the gradient norm, and whether a step is suspicious."""

    def __init__(self, spike_factor: float, loss_scaled: bool):
        self.factor = spike_factor
        self.loss_scaled = loss_scaled
        self.losses: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.norms: collections.deque[float] = collections.deque(maxlen=WINDOW)

    def suspicious(self, loss: float, sumsq: float) -> Optional[str]:
        """Why the step with this global loss and squared gradient norm should run again, or None."""
        norm = math.sqrt(sumsq) if sumsq >= 0 else math.nan  # NaN stays NaN, inf stays inf
        if not (math.isfinite(loss) and math.isfinite(norm)):
            return None if self.loss_scaled else f"loss {loss}, gradient norm {norm}"
        if self.factor <= 0 or len(self.losses) < MIN_HISTORY:
            return None
        for what, value, history in (("loss", loss, self.losses), ("gradient norm", norm, self.norms)):
            median = statistics.median(history)
            if value > self.factor * median:
                return f"{what} {value:.6g} is more than {self.factor:g} x the median {median:.6g}"
        return None

    def applied(self, loss: float, grad_norm: float) -> None:
        """Record a step the optimizer applied (its loss and gradient norm, both finite)."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.losses.append(loss)
            self.norms.append(grad_norm)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().reshape(-1)
    return t.view(torch.uint8) if t.is_floating_point() else t


def ranks_that_differ(first: tuple[torch.Tensor, ...], second: tuple[torch.Tensor, ...], group,
                      device: torch.device) -> list[int]:
    """The ranks of ``group`` whose two results are not bitwise equal (every rank learns the same list)."""
    mine = any(a.shape != b.shape or not torch.equal(_bits(a), _bits(b)) for a, b in zip(first, second))
    if not dist.is_initialized():
        return [0] if mine else []
    flags = torch.zeros(dist.get_world_size(group), dtype=torch.int32, device=device)
    flags[dist.get_rank(group)] = int(mine)
    dist.all_reduce(flags, group=group)
    return [r for r, f in enumerate(flags.tolist()) if f]
