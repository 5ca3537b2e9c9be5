"""TensorBoard as a second metrics sink beside W&B (``logging.tensorboard=true``).

Global rank 0's :class:`~megatier.observe.metrics.MetricsLogger` opens one with its other sinks and hands it the
same numeric fields it hands W&B (loss, lr, grad_norm, iter_time_s, the checkpoint and goodput metrics, val_loss),
each as a scalar tagged with its field name at the record's step. ``tensorboard`` is imported only when enabled;
config validation refuses ``logging.tensorboard=true`` without it, in one line.

    tensorboard --logdir runs/<name>/tensorboard
"""
from __future__ import annotations

import math


class TensorBoardSink:
    """A ``torch.utils.tensorboard.SummaryWriter`` on ``log_dir``, fed numeric record fields."""

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=log_dir)

    def log(self, scalars: dict, step: int) -> None:
        for key, value in scalars.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._writer.add_scalar(key, float(value), global_step=step)

    def close(self) -> None:
        self._writer.close()  # flushes the event file
