"""How a full tensor is cut across tensor-parallel ranks and put back together: the one formula the parallel
layers, the canonical optimizer state, checkpoint resharding and the Hugging Face interop all use.

A cut is (dim, stride): dim None means replicated; with stride s the dim is s blocks (q, k and v of a fused
projection, say), each cut into tp equal chunks separately.
"""
from __future__ import annotations

from typing import Optional

import torch


def shard_of_full(full: torch.Tensor, dim: Optional[int], stride: int, tp_rank: int, tp: int) -> torch.Tensor:
    """This rank's slice of a full tensor cut along ``dim``.

    With stride s the dim is laid out as (s, tp, chunk): each of the s blocks
    (e.g. q, k, v of a fused projection) is cut separately, and rank r keeps
    chunk r of every block.
    """
    if dim is None or tp == 1:
        return full
    size = full.shape[dim]
    if size % (stride * tp) != 0:
        raise ValueError(f"dim {dim} of size {size} cannot be split into stride {stride} x tp {tp}")
    shape = list(full.shape)
    blocks = full.reshape(shape[:dim] + [stride, tp, size // (stride * tp)] + shape[dim + 1:])
    mine = blocks.select(dim + 1, tp_rank)
    return mine.reshape(shape[:dim] + [size // tp] + shape[dim + 1:]).contiguous()


def full_from_shards(shards: list[torch.Tensor], dim: Optional[int], stride: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_of_full`: the full tensor from every tp rank's slice, in tp-rank order."""
    if dim is None or len(shards) == 1:
        return shards[0]
    shape = list(shards[0].shape)
    if shape[dim] % stride != 0:
        raise ValueError(f"dim {dim} of size {shape[dim]} cannot hold stride {stride}")
    blocks = [s.reshape(shape[:dim] + [stride, shape[dim] // stride] + shape[dim + 1:]) for s in shards]
    full = torch.stack(blocks, dim=dim + 1)  # (..., stride, tp, chunk, ...)
    return full.reshape(shape[:dim] + [shape[dim] * len(shards)] + shape[dim + 1:])
