"""Autograd regions for tensor parallelism (Megatron-LM's f/g operators).

Each function takes the tensor-parallel ``group`` explicitly. With a group of
size 1 every region is the identity, so tp=1 pays nothing.

| region                 | forward                   | backward                  |
|------------------------|---------------------------|---------------------------|
| copy_to_region         | identity                  | all-reduce                |
| reduce_from_region     | all-reduce                | identity                  |
| scatter_to_region      | keep own last-dim chunk   | all-gather last dim       |
| gather_from_region     | all-gather last dim       | keep own last-dim chunk   |
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
}


def copy_to_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _Region.apply(x, group, *_OPS["copy_to"])


def reduce_from_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _Region.apply(x, group, *_OPS["reduce_from"])


def scatter_to_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _Region.apply(x, group, *_OPS["scatter_to"])


def gather_from_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _Region.apply(x, group, *_OPS["gather_from"])
