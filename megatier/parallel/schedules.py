"""Forward/backward schedules over the micro-batches of one training step.

A schedule runs every micro-batch through this rank's model stage, accumulates
gradients (into the GradBuffer through parameter hooks) and returns the mean
loss over micro-batches as an fp32 scalar (meaningful on the last stage; 0 on
other stages).
"""
from __future__ import annotations

import torch
from torch import nn


def forward_backward_no_pipeline(model: nn.Module, microbatches: list[tuple[torch.Tensor, torch.Tensor]], *,
                                 loss_scale: float, forward_only: bool = False) -> torch.Tensor:
    """pp == 1: each micro-batch forward then backward; the loss is averaged over micro-batches."""
    total = torch.zeros((), dtype=torch.float32)
    n = len(microbatches)
    for tokens, labels in microbatches:
        with torch.set_grad_enabled(not forward_only):
            loss = model(tokens, labels).float().mean() / n  # per-token loss (b, s) -> scalar
        if not forward_only:
            (loss * loss_scale).backward()
        total += loss.detach().cpu()
    return total
