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


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad, ctx.group), None


def copy_to_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _ReduceFromRegion.apply(x, group)


def scatter_to_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _ScatterToRegion.apply(x, group)


def gather_from_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return _GatherFromRegion.apply(x, group)
