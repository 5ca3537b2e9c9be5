"""Route schedules: each micro-batch takes its own route through the stages' parts (CheckFree+, arXiv:2506.15461, 4.3).

A route is the sequence of hops (stage, part) one micro-batch takes, a part being
a stage's ``embed``, ``layers`` or ``head`` (:class:`~megatier.model.gpt.GPTStage`).
The standard route of P stages::

    embed@0, layers@0, layers@1, ..., layers@P-1, head@P-1

CheckFree+'s swapped route trades the transformer layers of stages 0 and 1, and
of stages P-2 and P-1 (P >= 4, so the two swaps are disjoint)::

    embed@0, layers@1, layers@0, layers@2, ..., layers@P-3, layers@P-1, layers@P-2, head@P-1

so stage 1's layers learn to take the embedding's output and stage 0's to feed
stage 2 (likewise at the end): each can stand in for the other when it is lost.
``model.pipeline_order=checkfree_plus`` sends the odd micro-batches of every step
the swapped way (:func:`checkfree_plus_routes`). Consecutive hops on one stage run
as one *segment* (no transfer).

Execution (GPipe-style: every forward, then every backward in reverse order):
every rank walks the same global list of (micro-batch, segment) in order and
runs the segments it owns; a segment receives its input from the stage of the
segment before (blocking) and posts its output to the stage of the segment after
(``isend``, waited at the end of the step). The smallest unfinished segment in
the global order always has its input posted, so this cannot deadlock; messages
between two stages are matched in the order both walk the list. Backward walks
the list in reverse with the gradients. Activations of all micro-batches stay
alive until their backward, as in GPipe.

Loss contract as :mod:`.schedules`: each micro-batch contributes its mean per-token
loss / n; the returned total is meaningful on the last stage, 0 elsewhere.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatier.parallel.p2p import PipelineComm
from megatier.parallel.schedules import Microbatches

Route = list[tuple[int, tuple[str, ...]]]  # segments: (stage, parts run there in order)


def route(num_stages: int, swapped: bool = False) -> Route:
    """The segments of a micro-batch's route through ``num_stages`` stages (module docstring)."""
    order = list(range(num_stages))
    if swapped:
        if num_stages < 4:
            raise ValueError(f"the swapped route needs at least 4 pipeline stages, got {num_stages}")
        order[0], order[1] = order[1], order[0]
        order[-2], order[-1] = order[-1], order[-2]
    hops = [(0, "embed"), *((s, "layers") for s in order), (num_stages - 1, "head")]
    segments: Route = []
    for stage, part in hops:
        if segments and segments[-1][0] == stage:
            segments[-1] = (stage, segments[-1][1] + (part,))
        else:
            segments.append((stage, (part,)))
    return segments


def checkfree_plus_routes(num_stages: int, n: int) -> list[Route]:
    """Routes of a step's ``n`` micro-batches under CheckFree+: the even ones standard, the odd ones swapped."""
    return [route(num_stages, swapped=i % 2 == 1) for i in range(n)]


def _run(model: nn.Module, parts: tuple[str, ...], x: Optional[torch.Tensor], tokens: torch.Tensor,
         labels: torch.Tensor, n: int) -> torch.Tensor:
    """One segment: the embedding of ``tokens``, the layers and/or the head (loss / n) applied in order."""
    for part in parts:
        if part == "embed":
            x = model.embed(tokens)
        elif part == "layers":
            x = model.run_layers(x)
        else:
            x = model.head(x, labels).float().mean() / n
    return x


def forward_backward_routes(model: nn.Module, microbatches: Microbatches, routes: list[Route], *,
                            comm: PipelineComm, hidden_size: int, loss_scale: float,
                            seq_shards: int = 1) -> torch.Tensor:
    """Forward then backward every micro-batch along its route (module docstring); returns the summed loss."""
    me, n = comm.stage, len(microbatches)
    total = torch.zeros((), dtype=torch.float32)
    saved: dict[tuple[int, int], tuple[Optional[torch.Tensor], torch.Tensor]] = {}
    posted: list = []  # (works, tensor on the wire): waited at the end of the step
    for i, (tokens, labels) in enumerate(microbatches):
        shape = (tokens.shape[0], tokens.shape[1] // seq_shards, hidden_size)  # (b, s, h), or s / tp under SP
        for k, (stage, parts) in enumerate(routes[i]):
            if stage != me:
                continue
            x = None
            if k > 0:
                x = comm.recv_from(routes[i][k - 1][0], shape).requires_grad_(True)
            y = _run(model, parts, x, tokens, labels, n)
            if k + 1 < len(routes[i]):
                posted.append(comm.isend_to(routes[i][k + 1][0], y))
            else:
                total += y.detach().cpu()
            saved[(i, k)] = (x, y)
    for i in reversed(range(n)):
        for k in reversed(range(len(routes[i]))):
            if routes[i][k][0] != me:
                continue
            x, y = saved.pop((i, k))
            if k + 1 == len(routes[i]):
                (y * loss_scale).backward()
            else:
                torch.autograd.backward(y, grad_tensors=comm.recv_from(routes[i][k + 1][0], tuple(y.shape)))
            if k > 0:
                posted.append(comm.isend_to(routes[i][k - 1][0], x.grad))
    for works, _ in posted:
        comm.wait(works)
    return total
