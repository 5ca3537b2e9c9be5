"""The flat-buffer collectives of the ZeRO-1 optimizer, on every torch MegaTier supports (2.4 on).

torch 2.13 names them ``all_gather_single`` and ``reduce_scatter_single``; older releases have the same
operations, with the same arguments, as ``all_gather_into_tensor`` and ``reduce_scatter_tensor``. Each helper
takes whichever this torch has, at the call (a test removes the new name to run the fallback).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``output`` (group size x shard size) = every rank's ``shard``, in rank order."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, shard, group=group)


def reduce_scatter_flat(shard: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``shard`` = this rank's slice of the sum of every rank's ``full`` (summed over the group)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(shard, full, group=group)
