"""Contiguous fp32 gradient buffer and its data-parallel reduction.

Every parameter's gradient is accumulated (across micro-batches) into an fp32
view of one flat buffer laid out exactly like the parameter buffer. After the
last micro-batch the buffer is averaged over dp (the routed experts' region over
the expert-data-parallel group), which leaves each dp rank the gradient of the
shard its ZeRO-1 optimizer owns: one contiguous range of each region, the unit
the checkpoint system saves and replays.

The reduction is always a :class:`~megatier.optim.overlap.BucketedReduce` (:attr:`GradBuffer.bucketed`), as in
Megatron-core, where buckets exist with or without the overlap: each owner sums the dp contributions of its
range in rank order, so the gradient shard is the same bits whatever the bucket size and whether the buckets
start from the hooks below (``parallel.overlap_grad_reduce``) or after backward, and a run may turn the overlap
on or off at any relaunch. Without :func:`megatier.optim.overlap.attach` (a bare buffer in a test or tool) it
is the default buckets, started after backward.

The reduction is timed on :attr:`GradBuffer.clock` (``dp_grad_wait_ms``): the time the step waits for it after
backward, all of it without the overlap.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from megatier.optim.buckets import bucket_numel
from megatier.optim.flat import FlatLayout
from megatier.optim.overlap import BucketedReduce
from megatier.optim.wait_clock import WaitClock


class GradBuffer:
    """fp32 main gradients; ``param.grad`` is folded in and released after each backward."""

    def __init__(self, module: nn.Module, layout: FlatLayout, device: torch.device, *, dp_group: dist.ProcessGroup,
                 expert_dp_group: Optional[dist.ProcessGroup] = None):
        self.layout = layout
        self.dp_group = dp_group
        self.expert_dp_group = expert_dp_group  # the expert region's (parallel.ep > 1; else the dp group's)
        self.flat = torch.zeros(layout.numel, dtype=torch.float32, device=device)
        self.clock = WaitClock(device)  # data-parallel communication the step waits for (also the optimizer's)
        self.bucketed: Optional[BucketedReduce] = None  # the bucketed reduction (megatier.optim.overlap.attach)
        self._hooks = []
        params = dict(module.named_parameters())
        for s in layout.segments:
            view = self.flat[s.offset:s.end].view(s.shape)
            self._hooks.append(params[s.name].register_post_accumulate_grad_hook(self._make_hook(s.name, view)))

    def _make_hook(self, name: str, main_grad: torch.Tensor):
        def fold(param: torch.Tensor) -> None:
            main_grad.add_(param.grad)  # upcasts bf16/fp16 grads into fp32
            param.grad = None
            if self.bucketed is not None:
                self.bucketed.folded(name, self.flat, self._groups())

        return fold

    def _groups(self) -> tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]:
        return self.dp_group, self.expert_dp_group or self.dp_group

    def zero(self, micro_batches: int = 0) -> None:
        """Clear the gradients before a step of ``micro_batches`` backward passes (0: not said; the bucketed
        reduction then starts every bucket after backward)."""
        self.flat.zero_()
        if self.bucketed is not None:
            self.bucketed.begin(micro_batches)

    def view_of(self, segment_name: str) -> torch.Tensor:
        s = next(seg for seg in self.layout.segments if seg.name == segment_name)
        return self.flat[s.offset:s.end]

    def all_reduce_segments(self, names: list[str], group: dist.ProcessGroup) -> None:
        """Sum the gradients of the named parameters over ``group`` (tied embedding copies)."""
        for name in names:
            dist.all_reduce(self.view_of(name), group=group)

    def reduce_scatter_mean(self, dp_rank: int) -> torch.Tensor:
        """Average over dp and return this rank's shard (a fresh tensor the optimizer may modify). A routed
        expert's gradient already sums the tokens of its whole ep group (they were dispatched to it), so the
        expert region is divided by dp too and summed over the expert-data-parallel group only."""
        if self.layout.dp == 1:
            return torch.cat([self.flat[lo:hi] for lo, hi in self.layout.shard_ranges(dp_rank)])
        if self.bucketed is None:
            self.bucketed = BucketedReduce(self.layout, dp_rank, bucket_numel(0), overlap=False, late=set())
        return self.bucketed.finish(self.flat, self._groups(), self.clock)

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
