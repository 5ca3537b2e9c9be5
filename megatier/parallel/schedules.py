"""Forward/backward schedules over the micro-batches of one training step.

A schedule runs every micro-batch through this rank's model stage, accumulates
gradients (into the GradBuffer through parameter hooks) and returns the mean
loss over micro-batches as an fp32 scalar: the last stage's, and on other
stages their own part of the objective (a stage's ``side_loss``: its MoE
layers' router losses; 0 for most), so the stages' sum is the step's loss.

Loss contract: each micro-batch contributes ``mean per-token loss / n`` (n =
micro-batches of this rank), so the accumulated gradient is that of the mean
loss of the rank's share of the global batch whatever the schedule. Backward
runs on ``loss * loss_scale`` (fp16 dynamic scaling; 1.0 otherwise).

1F1B (PipeDream-Flush, as in Megatron-LM), stage p of P with n micro-batches::

    warmup    min(P - p - 1, n) forwards, each output sent to stage p + 1
    steady    n - warmup rounds of: forward one micro-batch, backward the oldest
    cooldown  warmup backwards

so at most P - p micro-batches keep their activations alive on stage p.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatier.parallel.p2p import PipelineComm

Microbatches = list[tuple[torch.Tensor, torch.Tensor]]


def forward_backward_no_pipeline(model: nn.Module, microbatches: Microbatches, *,
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


def activation_shape(tokens: torch.Tensor, hidden_size: int, seq_shards: int = 1) -> tuple[int, int, int]:
    """What passes between stages: (b, s, h), or (b, s / tp, h) under sequence parallelism (``seq_shards``)."""
    return (tokens.shape[0], tokens.shape[1] // seq_shards, hidden_size)


def _forward_step(model: nn.Module, comm: PipelineComm, x: Optional[torch.Tensor], tokens: torch.Tensor,
                  labels: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Run one micro-batch through the stage; returns (stage input, output, side loss).

    The input is the token ids on the first stage, else the received activation
    (made a leaf that collects its gradient). The output is the scaled-down
    scalar loss on the last stage, else the hidden states (b, s, h); a non-last
    stage's own scaled-down loss rides beside them (None without one).
    """
    if comm.is_first:
        x = tokens
    elif torch.is_grad_enabled():
        x.requires_grad_(True)
    if comm.is_last:
        return x, model(x, labels).float().mean() / n, None
    y = model(x)
    side = model.side_loss()
    return x, y, None if side is None else side.float() / n


def _backward_step(comm: PipelineComm, x: torch.Tensor, y: torch.Tensor, side: Optional[torch.Tensor],
                   grad_y: Optional[torch.Tensor], loss_scale: float) -> Optional[torch.Tensor]:
    """Backpropagate one micro-batch; returns the gradient of the stage input (None on the first stage)."""
    if comm.is_last:
        (y * loss_scale).backward()
    elif side is None:
        torch.autograd.backward(y, grad_tensors=grad_y)
    else:
        torch.autograd.backward([y, side * loss_scale], grad_tensors=[grad_y, None])
    return None if comm.is_first else x.grad


def forward_backward_1f1b(model: nn.Module, microbatches: Microbatches, *, comm: PipelineComm, hidden_size: int,
                          seq_shards: int = 1,
                          loss_scale: float) -> torch.Tensor:
    """pp > 1: one-forward-one-backward over the micro-batches (see the module docstring)."""
    n = len(microbatches)
    shapes = [activation_shape(tokens, hidden_size, seq_shards) for tokens, _ in microbatches]
    warmup = min(comm.num_stages - comm.stage - 1, n)
    total = torch.zeros((), dtype=torch.float32)
    # Micro-batches forwarded but not yet backpropagated, oldest first: (input, output, side loss).
    in_flight: list[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]] = []

    def forward(i: int, x: Optional[torch.Tensor]) -> torch.Tensor:
        nonlocal total
        x, y, side = _forward_step(model, comm, x, *microbatches[i], n)
        if comm.is_last or side is not None:
            total += (y if side is None else side).detach().cpu()
        in_flight.append((x, y, side))
        return y

    for i in range(warmup):
        comm.send_forward(forward(i, comm.recv_forward(shapes[i])))

    x = comm.recv_forward(shapes[warmup]) if warmup < n else None
    for i in range(warmup, n):
        grad_y = comm.send_forward_recv_backward(forward(i, x), shapes[i - warmup])
        grad_x = _backward_step(comm, *in_flight.pop(0), grad_y, loss_scale)
        if i + 1 < n:
            x = comm.send_backward_recv_forward(grad_x, shapes[i + 1])
        else:
            comm.send_backward(grad_x)

    for i in range(n - warmup, n):
        grad_y = comm.recv_backward(shapes[i])
        comm.send_backward(_backward_step(comm, *in_flight.pop(0), grad_y, loss_scale))
    return total


@torch.no_grad()
def forward_pipeline(model: nn.Module, microbatches: Microbatches, *, comm: PipelineComm,
                     hidden_size: int, seq_shards: int = 1) -> torch.Tensor:
    """pp > 1, evaluation: every micro-batch flows forward through the stages; no backward."""
    n = len(microbatches)
    total = torch.zeros((), dtype=torch.float32)
    for tokens, labels in microbatches:
        x = comm.recv_forward(activation_shape(tokens, hidden_size, seq_shards))
        _, y, _ = _forward_step(model, comm, x, tokens, labels, n)
        if comm.is_last:
            total += y.float().cpu()
        else:
            comm.send_forward(y)
    comm.take_bubble_ms()  # evaluation's waits are no training step's bubble
    return total
