"""Learning-rate schedules with the semantics of Megatron-core's ``OptimizerParamScheduler``.

Linear warmup from ``warmup_init_lr`` to ``lr``, then one decay style: constant,
linear, cosine, inverse-square-root, or WSD (warmup-stable-decay: ``lr`` until
the last ``wsd_decay_iters`` steps of the horizon, then one of its decay-phase
styles down to ``min_lr``). Megatron's scheduler counts samples (an iteration
advances it by the global batch) and so does this one: the same operations on
the same numbers give the same floats, bit for bit.

With a batch-size ramp-up the samples of a step follow the ramp, as Megatron's
do. The rate is a pure function of the step, so a resume needs no scheduler state:
the schedule's settings are in the job's config fingerprint instead
(megatier.config.fingerprint).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Optional

from megatier.config import OptimConfig
from megatier.config.fingerprint import SCHEDULE_KEYS, recorded_value
from megatier.config.schema import LR_DECAY_STYLES, WSD_DECAY_STYLES
from megatier.data.ramp import BatchRamp


@dataclass(frozen=True)
class LRSchedule:
    """lr for optimizer step ``step`` (1-based): Megatron's ``get_lr`` once its scheduler has counted ``step``
    global batches of ``batch`` samples. Past ``decay_iters`` every style but constant stays at ``min_lr``."""

    lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    decay_style: str = "cosine"
    batch: int = 1  # samples per step
    warmup_fraction: Optional[float] = None  # set: the warmup is this fraction of the decay horizon
    warmup_init_lr: float = 0.0
    wsd_decay_iters: Optional[int] = None
    wsd_decay_style: str = "exponential"
    # A batch-size ramp-up: the samples of each step; the horizons still count ``batch`` samples a step
    # (Megatron's --lr-*-samples of a ramped job are its --lr-*-iters times the full global batch).
    ramp: Optional[BatchRamp] = None

    def __call__(self, step: int) -> float:
        if step < 1:
            raise ValueError(f"learning-rate steps start at 1, got {step}")
        return self.at_samples(self.samples_after(step))

    def samples_after(self, step: int) -> int:
        """The samples consumed by steps 1 .. ``step``."""
        return self.ramp.consumed_before(step + 1) if self.ramp is not None else step * self.batch

    def warmup_samples(self) -> float:
        """Megatron's ``lr_warmup_steps``: a float when it is a fraction of the horizon."""
        if self.warmup_fraction is not None:
            return self.warmup_fraction * (self.decay_iters * self.batch)
        return self.warmup_iters * self.batch

    def at_samples(self, samples: int) -> float:
        """The rate once ``samples`` samples were consumed (Megatron's ``num_steps``)."""
        max_lr, warmup = float(self.lr), self.warmup_samples()
        if warmup > 0 and samples <= warmup:
            return self.warmup_init_lr + (max_lr - self.warmup_init_lr) * float(samples) / float(warmup)
        if self.decay_style == "constant":
            return max_lr
        decay = self.decay_iters * self.batch
        if samples > decay:
            return self.min_lr
        if self.decay_style == "inverse-square-root":
            rate = max_lr * max(warmup, 1) ** 0.5 / (max(samples, 1) ** 0.5)
            return max(self.min_lr, rate)
        ratio = float(samples - warmup) / float(decay - warmup)
        return self.min_lr + self._coeff(samples, ratio, decay) * (max_lr - self.min_lr)

    def _coeff(self, samples: int, ratio: float, decay: int) -> float:
        if self.decay_style == "linear":
            return 1.0 - ratio
        if self.decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if self.decay_style != "wsd":
            raise ValueError(f"unknown learning-rate decay style {self.decay_style!r}; one of "
                             f"{', '.join(LR_DECAY_STYLES)}")
        wsd = self.wsd_decay_iters * self.batch
        if samples <= decay - wsd:
            return 1.0
        return wsd_coeff(self.wsd_decay_style, float(samples - (decay - wsd)) / float(wsd))

    def following(self, recorded: dict[str, str]) -> "LRSchedule":
        """This schedule with the values a job's record holds for its keys (``optim.<field>``: JSON, as the
        config fingerprint has them); a key the record lacks keeps this schedule's value, unless it was added
        after the record was written, which trained with its earlier value then."""
        found = {key: recorded_value(recorded, key) for key in SCHEDULE_KEYS} if recorded else {}
        values = {key.removeprefix("optim."): json.loads(v) for key, v in found.items() if v is not None}
        return dataclasses.replace(self, **values)

    def state_dict(self) -> dict:
        return dataclasses.asdict(self)


def wsd_coeff(style: str, ratio: float) -> float:
    """The share of ``lr - min_lr`` left at ``ratio`` (0..1) of WSD's decay phase."""
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        return (2.0 * math.pow(0.5, ratio)) - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(ratio)
    raise ValueError(f"unknown WSD decay style {style!r}; one of {', '.join(WSD_DECAY_STYLES)}")


def schedule_of(o: OptimConfig, iters: int, global_batch_size: int, ramp: Optional[BatchRamp] = None) -> LRSchedule:
    """The schedule ``o`` names for a job of ``iters`` steps (the horizon when ``o.decay_iters`` is unset) and
    its batches (``ramp``: a batch-size ramp-up, megatier.data.ramp)."""
    return LRSchedule(o.lr, o.min_lr, o.warmup_iters, o.decay_iters or iters, decay_style=o.decay_style,
                      batch=global_batch_size, warmup_fraction=o.warmup_fraction, warmup_init_lr=o.warmup_init_lr,
                      wsd_decay_iters=o.wsd_decay_iters, wsd_decay_style=o.wsd_decay_style,
                      ramp=ramp if ramp is not None and ramp.start else None)
