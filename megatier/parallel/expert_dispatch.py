"""Dropless token dispatch to routed experts, over an expert-parallel group (``parallel.ep``).

With ep ranks in a group, rank i holds the experts [i E/ep, (i+1) E/ep) of every MoE layer. A layer's step:

1. each rank sorts its (token, choice) slots by expert (a stable sort, so a token's order is kept inside an
   expert) and tells every other rank how many slots it sends to each of that rank's experts (one all-to-all
   of E counts);
2. the slots' tokens go to their experts' ranks (all-to-all; each destination gets a run per expert);
3. each rank runs its experts on what it got, one call per (source rank, expert): an expert sees the tokens of
   one source at a time, exactly the rows it would see at ep=1 on that source rank, so its outputs and its
   weight gradient's per-source parts are bitwise those of ep=1;
4. the outputs come back the same way (all-to-all), and each rank sums its tokens' k expert outputs, weighted
   by the router, in global expert order, as ep=1 does.

Nothing is dropped: the runs have whatever length the router gave them (no capacity). An expert no token chose
runs on no rows, so its parameters still take part in the step (a zero gradient). The backward of each
all-to-all is the all-to-all of the gradients the other way. Every rank of the group runs the same layers in
the same order (the same pipeline schedule, the same recomputation), so the collectives pair up.

At ep=1 (``group`` None) the same code runs without collectives.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` (cut by ``send``) to the group's ranks, rows from them (``recv`` each); the gradient goes
    back the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    return out


def local_experts(num_experts: int, ep: int, ep_rank: int) -> range:
    """The global indices of the experts ep rank ``ep_rank`` of ``ep`` holds."""
    per_rank = num_experts // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def _counts_from_sources(counts: torch.Tensor, ep: int, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """(ep, E/ep): the slots each rank of the group sends to each of this rank's experts, from this rank's
    slots per expert (E,)."""
    if group is None:
        return counts.view(1, -1)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    return received.view(ep, -1)


def dispatch_to_experts(tokens: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor,
                        expert: Callable[[int, torch.Tensor], torch.Tensor], num_experts: int,
                        group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """tokens (n, h), expert_ids and weights (n, k) -> sum over k of weight * expert(token), (n, h).

    ``expert(e, x)``: global expert ``e`` (one of this rank's) on rows ``x`` (m, h) -> (m, h). ``group``: the
    expert-parallel group (None: this rank holds every expert)."""
    ep = dist.get_world_size(group) if group is not None else 1
    k = expert_ids.shape[-1]
    slots = torch.argsort(expert_ids.flatten(), stable=True)  # (token, choice) slots grouped by expert
    counts = torch.bincount(expert_ids.flatten(), minlength=num_experts)
    per_expert = counts.tolist()
    rows = [group_slots // k for group_slots in slots.split(per_expert)]
    sent = torch.cat([tokens[r] for r in rows])
    from_sources = _counts_from_sources(counts, ep, group)
    send = counts.view(ep, -1).sum(1).tolist()
    recv = from_sources.sum(1).tolist()
    got = _AllToAll.apply(sent, send, recv, group) if group is not None else sent
    mine = local_experts(num_experts, ep, dist.get_rank(group) if group is not None else 0)
    runs = got.split(from_sources.flatten().tolist())  # source-major, then expert
    outputs = torch.cat([expert(mine[i % len(mine)], x) for i, x in enumerate(runs)])
    back = _AllToAll.apply(outputs, recv, send, group) if group is not None else outputs
    out = torch.zeros_like(tokens)
    flat_weights = weights.flatten()
    for group_slots, r, y in zip(slots.split(per_expert), rows, back.split(per_expert)):
        out.index_add_(0, r, y * flat_weights[group_slots].unsqueeze(-1))
    return out
