"""Learning-rate schedule: linear warmup, then cosine decay to min_lr."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class WarmupCosine:
    """lr for optimizer step ``step`` (1-based), a pure function of the step.

    Steps 1..warmup ramp linearly to ``lr``; then the rate follows half a cosine
    down to ``min_lr`` at step ``decay_iters`` and stays there.
    """

    lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int

    def __call__(self, step: int) -> float:
        if step < 1:
            raise ValueError(f"learning-rate steps start at 1, got {step}")
        if self.warmup_iters > 0 and step <= self.warmup_iters:
            return self.lr * step / self.warmup_iters
        if step >= self.decay_iters:
            return self.min_lr
        progress = (step - self.warmup_iters) / max(1, self.decay_iters - self.warmup_iters)
        return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.lr - self.min_lr)

    def state_dict(self) -> dict:
        return {"lr": self.lr, "min_lr": self.min_lr, "warmup_iters": self.warmup_iters,
                "decay_iters": self.decay_iters}
