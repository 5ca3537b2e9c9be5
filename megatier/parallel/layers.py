"""Tensor-parallel layers: column/row-parallel linears and a vocab-parallel embedding.

Every parameter records how it is cut across tensor-parallel ranks
(``tp_partition_dim`` and ``tp_partition_stride``; dim None means replicated),
so the model can initialise the full tensor from a per-name seed and keep only
this rank's slice. Initial weights therefore do not depend on the layout.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatier.parallel.mappings import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
)


def mark_partition(param: nn.Parameter, dim: Optional[int], stride: int = 1) -> nn.Parameter:
    param.tp_partition_dim = dim
    param.tp_partition_stride = stride
    return param


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A cut by output rows: (out/tp, in) per rank.

    Input (..., in) replicated across tp, or with ``sequence_parallel`` (b, s/tp, in), this rank's tokens (the
    sequence is gathered first); output (..., out/tp) unless ``gather_output``.
    """

    def __init__(self, in_features: int, out_features: int, *, group: dist.ProcessGroup, bias: bool = True,
                 gather_output: bool = False, stride: int = 1, sequence_parallel: bool = False):
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        tp = dist.get_world_size(group)
        if out_features % (tp * stride) != 0:
            raise ValueError(f"output size {out_features} is not divisible by tp={tp} x stride={stride}")
        if gather_output and stride != 1 and tp > 1:
            # Gathering rank chunks of a strided split interleaves the blocks (q0 k0 v0 q1 k1 v1),
            # which is not the unsplit output order.
            raise ValueError("gather_output needs stride 1: a strided output cannot be gathered in order")
        self.gather_output = gather_output
        self.weight = mark_partition(nn.Parameter(torch.empty(out_features // tp, in_features)), 0, stride)
        self.bias = mark_partition(nn.Parameter(torch.empty(out_features // tp)), 0, stride) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = gather_from_sequence(x, self.group) if self.sequence_parallel else copy_to_region(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A cut by input columns: (out, in/tp) per rank.

    Input (..., in/tp) already split across tp; output (..., out) all-reduced, or with ``sequence_parallel``
    reduce-scattered to this rank's tokens (b, s/tp, out); then the replicated bias is added once (with
    ``sequence_parallel`` to this rank's tokens only: its gradient is then a partial sum, marked
    ``sequence_parallel`` for the trainer to all-reduce over tp).
    """

    def __init__(self, in_features: int, out_features: int, *, group: dist.ProcessGroup, bias: bool = True,
                 sequence_parallel: bool = False):
        super().__init__()
        self.group = group
        self.sequence_parallel = sequence_parallel
        tp = dist.get_world_size(group)
        if in_features % tp != 0:
            raise ValueError(f"input size {in_features} is not divisible by tp={tp}")
        self.weight = mark_partition(nn.Parameter(torch.empty(out_features, in_features // tp)), 1)
        self.bias = mark_partition(nn.Parameter(torch.empty(out_features)), None) if bias else None
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence(partial, self.group)
        else:
            y = reduce_from_region(partial, self.group)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are cut across tp: rank r owns [r*V/tp, (r+1)*V/tp)."""

    def __init__(self, vocab_size: int, hidden_size: int, *, group: dist.ProcessGroup):
        super().__init__()
        self.group = group
        tp, tp_rank = dist.get_world_size(group), dist.get_rank(group)
        if vocab_size % tp != 0:
            raise ValueError(f"padded vocabulary {vocab_size} is not divisible by tp={tp}")
        self.per_rank = vocab_size // tp
        self.vocab_start = tp_rank * self.per_rank
        self.weight = mark_partition(nn.Parameter(torch.empty(self.per_rank, hidden_size)), 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if dist.get_world_size(self.group) == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_region(out, self.group)
