"""Batch-size ramp-up with Megatron's semantics (``--rampup-batch-size start increment samples``).

The global batch starts at ``start`` and grows by ``increment`` each time another
``samples / n`` samples were consumed (n increments up to the full global batch),
which it reaches once ``samples`` were: Megatron-core's
``RampupBatchsizeNumMicroBatchesCalculator``. Each step's batch and the samples
consumed before it are pure functions of the step, like the LR, so a resume
anywhere in the ramp reads the same samples and trains at the same rate.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Optional, Sequence


@dataclass(frozen=True)
class BatchRamp:
    """The global batch of every step; ``start`` 0 means no ramp (every step has ``global_batch_size``)."""

    global_batch_size: int
    start: int = 0
    increment: int = 0
    samples: int = 0

    @classmethod
    def of(cls, global_batch_size: int, rampup: Optional[Sequence[int]]) -> "BatchRamp":
        """From ``train.rampup_batch_size`` ([start, increment, samples], or None for no ramp)."""
        return cls(global_batch_size, *rampup) if rampup else cls(global_batch_size)

    def batch_at(self, consumed: int) -> int:
        """The global batch once ``consumed`` samples were consumed (Megatron's ``update``)."""
        if not self.start or consumed > self.samples:
            return self.global_batch_size
        per_increment = self.samples / ((self.global_batch_size - self.start) // self.increment)
        return self.start + int(consumed / per_increment) * self.increment

    @cached_property
    def _ramp(self) -> tuple[int, ...]:
        """The samples consumed before each step of the ramp; the last entry starts the first full batch."""
        consumed, before = 0, [0]
        while self.batch_at(consumed) < self.global_batch_size:
            consumed += self.batch_at(consumed)
            before.append(consumed)
        return tuple(before)

    def consumed_before(self, step: int) -> int:
        """Samples consumed by steps 1 .. ``step`` - 1 (the data position of step ``step``, 1-based)."""
        ramp = self._ramp
        if step <= len(ramp):
            return ramp[step - 1]
        return ramp[-1] + (step - len(ramp)) * self.global_batch_size

    def batch(self, step: int) -> int:
        """The global batch of step ``step`` (1-based)."""
        return self.batch_at(self.consumed_before(step))
