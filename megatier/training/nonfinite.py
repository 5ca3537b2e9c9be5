"""What a step whose loss or gradient is not finite does (``reliability.on_nonfinite``), and when a run of
skipped steps means the run has diverged (``reliability.max_consecutive_skips``).

A NaN or inf in fp32 or bf16 training is never a step to take or to checkpoint: every step after it would
train from, save, replicate and replay a state that cannot recover. Megatron-LM stops on one by default
(``--check-for-nan-in-loss-and-grad``). The optimizer applies nothing when the global gradient norm is not
finite, or when a gradient element's square overflows fp32 (the second moment would become inf although the
float64 norm stays finite: :class:`~megatier.optim.adamw.DistributedAdamW`); then, in fp32 and bf16:

- ``stop`` (the default): the run stops with :class:`NonFiniteStep`, one line naming the step, the ranks and
  the first tensor whose gradient is not finite on each. The step is not checkpointed; the entry point closes
  the checkpointer, so the checkpoints end at the step before, made durable (exit status 5,
  :mod:`megatier.training.outcome`);
- ``skip_step``: the step is skipped as fp16's loss scaler skips an overflow: nothing applied, the diff stream
  records only the flag, never the gradient.

In fp16 an overflow is the loss scaler's business (it halves the scale and the step is skipped). Either way
more than ``max_consecutive_skips`` skipped steps in a row stop the run as diverged: a scale that keeps
overflowing down to its minimum, or a loss that stays NaN, is not going to train.

The decision is the same on every rank: the gradient norm it reads is all-reduced over the whole job.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from megatier.config.schema import ReliabilityConfig


class NonFiniteStep(RuntimeError):
    """The run stopped on a non-finite loss or gradient, or a run of skipped steps (raised on every rank)."""


def first_nonfinite(grad: torch.Tensor, segments) -> Optional[str]:
    """The name of the first segment of this rank's gradient shard holding a NaN or inf, or an element whose
    square overflows fp32 (the optimizer's second moment would), or None."""
    for seg in segments:
        part = grad[seg.shard_offset: seg.shard_offset + seg.numel]
        if part.numel() and not bool(torch.isfinite(part * part).all()):
            return seg.name
    return None


class NonFiniteGuard:
    """Checks every step's outcome (:meth:`check`); raises :class:`NonFiniteStep` to stop the run."""

    def __init__(self, cfg: ReliabilityConfig, loss_scaled: bool, rank: int, group=None):
        self.cfg = cfg
        self.loss_scaled = loss_scaled  # fp16: the loss scaler owns overflows
        self.rank = rank
        self.group = group
        self.skips_in_a_row = 0
        self.nonfinite_steps = 0  # non-finite steps skipped under skip_step

    def check(self, step: int, skipped: bool, loss: float, grad: torch.Tensor, segments) -> None:
        """After step ``step``'s optimizer update (``skipped``: nothing was applied). Collective when the step
        is non-finite outside fp16 (every rank names its first non-finite tensor)."""
        if not skipped:
            self.skips_in_a_row = 0
            return
        self.skips_in_a_row += 1
        if not self.loss_scaled:
            if self.cfg.on_nonfinite == "stop":
                raise NonFiniteStep(self._nonfinite_line(step, loss, grad, segments))
            self.nonfinite_steps += 1
        if self.skips_in_a_row > self.cfg.max_consecutive_skips:
            what = "fp16 overflows (the loss scale backed off as far as it goes)" if self.loss_scaled else \
                "steps with a non-finite loss or gradient"
            raise NonFiniteStep(f"step {step}: {self.skips_in_a_row} {what} in a row, more than "
                                f"reliability.max_consecutive_skips={self.cfg.max_consecutive_skips}: the run "
                                f"diverged after step {step - self.skips_in_a_row}; lower optim.lr or optim.clip_grad "
                                f"and relaunch")

    def _nonfinite_line(self, step: int, loss: float, grad: torch.Tensor, segments) -> str:
        mine = first_nonfinite(grad, segments)
        names: list[Optional[str]] = [mine]
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            names = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(names, mine, group=self.group)
        found = [f"rank {r}: {name}" for r, name in enumerate(names) if name is not None]
        where = "; ".join(found[:4]) + (f"; and {len(found) - 4} more ranks" if len(found) > 4 else "")
        loss_part = f"loss {loss}" if not math.isfinite(loss) else f"loss {loss:.6g}"
        return (f"step {step}: the gradient is not finite or its square overflows fp32 ({loss_part}; first such "
                f"tensor: {where or 'none: only the loss'}); nothing of this step was applied or checkpointed. "
                f"Lower optim.lr or optim.clip_grad and relaunch, or set reliability.on_nonfinite=skip_step to skip "
                f"such steps")
