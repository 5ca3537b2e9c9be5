"""The flat-buffer all-gather of the ZeRO-1 optimizer, on every torch MegaTier supports (2.4 on).

torch 2.13 names it ``all_gather_single``; older releases have the same operation, with the same arguments, as
``all_gather_into_tensor``. The helper takes whichever this torch has, at the call (a test removes the new name
to run the fallback). The gradient reduction is bucketed (:mod:`megatier.optim.buckets`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup) -> None:
    """``output`` (group size x shard size) = every rank's ``shard``, in rank order."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, shard, group=group)

