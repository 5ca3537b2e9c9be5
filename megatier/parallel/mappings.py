"""Autograd regions for tensor parallelism (Megatron-LM's f/g operators).

Each function takes the tensor-parallel ``group`` explicitly. With a group of
size 1 every region is the identity, so tp=1 pays nothing.

| region                 | forward                   | backward                  |
|------------------------|---------------------------|---------------------------|
| copy_to_region         | identity                  | all-reduce                |
| reduce_from_region     | all-reduce                | identity                  |
| scatter_to_region      | keep own last-dim chunk   | all-gather last dim       |
| gather_from_region     | all-gather last dim       | keep own last-dim chunk   |

Sequence parallelism (``parallel.sequence_parallel``) cuts activations along the sequence (dim 1 of
``(b, s, h)``) between the tensor-parallel linears, with three more regions:

| region                      | forward                    | backward                   |
|-----------------------------|----------------------------|----------------------------|
| scatter_to_sequence         | keep own sequence chunk    | all-gather the sequence    |
| gather_from_sequence        | all-gather the sequence    | reduce-scatter the sequence|
| reduce_scatter_to_sequence  | reduce-scatter the sequence| all-gather the sequence    |

A column-parallel linear's input goes through gather_from_sequence (each rank computes its output columns for
every token, and the gradient of its input slice is the sum over the ranks' columns); a row-parallel linear's
partial sums leave through reduce_scatter_to_sequence (summed over the ranks, each keeping its tokens).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return x
    x = x.clone()  # never reduce into a tensor autograd may still need
    dist.all_reduce(x, group=group)
    return x


def _split_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    if x.shape[-1] % size != 0:
        raise ValueError(f"last dim {x.shape[-1]} is not divisible by the tensor-parallel size {size}")
    return x.chunk(size, dim=-1)[dist.get_rank(group)].contiguous()


def _gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _identity(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x


def _split_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    if x.shape[1] % size != 0:
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by the tensor-parallel size {size}")
    return x.chunk(size, dim=1)[dist.get_rank(group)].contiguous()


def _gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    if size == 1:
        return x
    if x.shape[1] % size != 0:
        raise ValueError(f"sequence length {x.shape[1]} is not divisible by the tensor-parallel size {size}")
    parts = [p.contiguous() for p in x.chunk(size, dim=1)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


class _Region(torch.autograd.Function):
    """Applies ``forward_op`` to the input and ``backward_op`` to its gradient, both over ``group``."""

    @staticmethod
    def forward(ctx, x, group, forward_op, backward_op):
        ctx.group, ctx.backward_op = group, backward_op
        return forward_op(x, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad, ctx.group), None, None, None


# The table in the module docstring, row by row: (forward, backward).
_OPS = {
    "copy_to": (_identity, _all_reduce),
    "reduce_from": (_all_reduce, _identity),
    "scatter_to": (_split_last_dim, _gather_last_dim),
    "gather_from": (_gather_last_dim, _split_last_dim),
    "scatter_to_sequence": (_split_sequence, _gather_sequence),
    "gather_from_sequence": (_gather_sequence, _reduce_scatter_sequence),
    "reduce_scatter_to_sequence": (_reduce_scatter_sequence, _gather_sequence),
}


def copy_to_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _Region.apply(x, group, *_OPS["copy_to"])


def reduce_from_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _Region.apply(x, group, *_OPS["reduce_from"])


def scatter_to_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _Region.apply(x, group, *_OPS["scatter_to"])


def gather_from_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _Region.apply(x, group, *_OPS["gather_from"])


def scatter_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _Region.apply(x, group, *_OPS["scatter_to_sequence"])


def gather_from_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _Region.apply(x, group, *_OPS["gather_from_sequence"])


def reduce_scatter_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _Region.apply(x, group, *_OPS["reduce_scatter_to_sequence"])
