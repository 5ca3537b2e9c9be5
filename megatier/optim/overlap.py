"""Overlapped data-parallel communication: bucket by bucket, while the computation goes on.

``parallel.overlap_grad_reduce``: a bucket's gradient reduction (:mod:`megatier.optim.buckets`) starts from the
gradient hooks as soon as its parameters' gradients of the step's last micro-batch are folded in, while
backward goes on with earlier layers; the optimizer waits for them all. A bucket whose gradients change after
backward (a tied embedding's copies summed over the embedding group, CheckFree+'s replicas, sequence-parallel
parameters summed over tp) and the routed experts' buckets (an expert that got no tokens on some rank has no
hook there, and every rank must start the same collectives in the same order) start after backward, in bucket
order, with the buckets whose hooks never fired.

``parallel.overlap_param_gather``: after the optimizer step every bucket's parameter gather starts at once, in
forward order, and a module's forward pre-hook waits only for the buckets (of each region) up to the last one
holding a parameter of its subtree, so the next forward (or evaluation) begins while later buckets are still
on the wire.

Neither object keeps a process group: they get them at each call from their owners (the gradient buffer, the
optimizer), which in-process recovery detaches and re-attaches (``megatier.parallel.state.detach_groups``).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from megatier.config import ParallelConfig
from megatier.optim.buckets import Bucket, bucket_numel, launch_gather, launch_reduce, plan_buckets, sum_rows
from megatier.optim.flat import FlatLayout
from megatier.optim.wait_clock import WaitClock

Groups = tuple[Optional[dist.ProcessGroup], Optional[dist.ProcessGroup]]  # (dense region's, experts')


class BucketedReduce:
    """The gradient shard by buckets; with ``overlap``, each started by the hooks of its last gradients."""

    def __init__(self, layout: FlatLayout, dp_rank: int, numel: int, *, overlap: bool, late: set[str]):
        self.layout = layout
        self.buckets = plan_buckets(layout, dp_rank, numel)
        self._bucket_of = {name: b.index for b in self.buckets for name in b.names}
        self._early = [overlap and b.region == 0 and not late.intersection(b.names) for b in self.buckets]
        self._left: list[int] = []  # gradients each bucket still waits for in this step ([]: none started early)
        self._pending: dict[int, tuple[torch.Tensor, Optional[dist.Work]]] = {}

    def begin(self, micro_batches: int) -> None:
        """A new step of ``micro_batches`` backward passes (0: unknown; every bucket then starts at the end).
        Works of a step that never finished (a failed one) are dropped."""
        self._pending.clear()
        self._left = [len(b.names) * micro_batches for b in self.buckets] if micro_batches else []

    def folded(self, name: str, grad_flat: torch.Tensor, groups: Groups) -> None:
        """Parameter ``name``'s gradient of one micro-batch is in ``grad_flat``: start its bucket if complete."""
        if not self._left:
            return
        index = self._bucket_of[name]
        self._left[index] -= 1
        if self._left[index] == 0 and self._early[index]:
            self._launch(self.buckets[index], grad_flat, groups)

    def _launch(self, bucket: Bucket, grad_flat: torch.Tensor, groups: Groups) -> None:
        self._pending[bucket.index] = launch_reduce(bucket, grad_flat, self.layout.dp, groups[bucket.region])

    def finish(self, grad_flat: torch.Tensor, groups: Groups, clock: WaitClock) -> torch.Tensor:
        """Start the buckets not started yet (in bucket order), wait for all, and return this rank's shard
        (a fresh tensor); the time waited is ``dp_grad_wait_ms``."""
        for bucket in self.buckets:
            if bucket.index not in self._pending:
                self._launch(bucket, grad_flat, groups)
        works = [work for _, work in self._pending.values() if work is not None]
        if works:
            with clock.timing("dp_grad_wait_ms"):
                for work in works:
                    work.wait()
        shard = torch.empty(self.layout.shard_size, dtype=torch.float32, device=grad_flat.device)
        for bucket in self.buckets:
            if bucket.piece_numel:
                recv, _ = self._pending[bucket.index]
                shard[bucket.shard_offset:bucket.shard_offset + bucket.piece_numel] = sum_rows(bucket, recv)
        self._pending.clear()
        self._left = []
        return shard


class BucketedGather:
    """The parameter all-gather by buckets, waited for by the forward pre-hooks of the modules that use them."""

    def __init__(self, layout: FlatLayout, dp_rank: int, numel: int, module: nn.Module, clock: WaitClock):
        self.buckets = plan_buckets(layout, dp_rank, numel)
        self.clock = clock
        self._works: dict[int, dist.Work] = {}
        bucket_of = {name: b for b in self.buckets for name in b.names}
        self._hooks = []
        for prefix, child in module.named_modules():
            # The stage itself waits for its own parameters; any other module for its whole subtree's, since a
            # module may read a child's weight without calling the child (F.linear(x, self.proj.weight)).
            names = [f"{prefix}.{n}" if prefix else n for n, _ in child.named_parameters(recurse=child is not module)]
            upto: dict[int, int] = {}
            for b in (bucket_of[n] for n in names if n in bucket_of):
                upto[b.region] = max(upto.get(b.region, -1), b.index)
            if upto:
                self._hooks.append(child.register_forward_pre_hook(self._waiter(upto)))

    def _waiter(self, upto: dict[int, int]):
        def wait(_module, _inputs) -> None:
            for region, index in upto.items():
                self.wait(region, index)

        return wait

    def launch(self, param_flat: torch.Tensor, groups: Groups) -> None:
        """Start every bucket's gather (this rank's pieces already hold the new parameters)."""
        self.wait()
        for bucket in self.buckets:
            work = launch_gather(bucket, param_flat, groups[bucket.region])
            if work is not None:
                self._works[bucket.index] = work

    def wait(self, region: Optional[int] = None, upto: Optional[int] = None) -> None:
        """Wait for the gathers of ``region``'s buckets up to index ``upto`` (None: every one); ``dp_param_wait_ms``."""
        due = [i for i in self._works if (region is None or self.buckets[i].region == region)
               and (upto is None or i <= upto)]
        if not due:
            return
        with self.clock.timing("dp_param_wait_ms"):
            for i in sorted(due):
                self._works.pop(i).wait()

    def discard(self) -> None:
        """Forget the gathers in flight (a restore writes every parameter again; their group may be gone)."""
        self._works.clear()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def late_parameters(module: nn.Module) -> set[str]:
    """Names of the parameters whose gradients change after backward: sequence-parallel ones (summed over tp),
    the tied embedding's copies (``shared_embedding_params``) and copies of another parameter (CheckFree+'s
    replicas, ``copy_of``)."""
    shared = getattr(module, "shared_embedding_params", lambda: [])()
    return {name for name, p in module.named_parameters()
            if getattr(p, "sequence_parallel", False) or getattr(p, "copy_of", "") or any(p is q for q in shared)}


def attach(parallel: ParallelConfig, module: nn.Module, grads, optimizer) -> None:
    """Give ``grads`` (a GradBuffer) and ``optimizer`` (a DistributedAdamW) their bucketed communication as
    ``parallel`` asks, in buckets of ``bucket_mb``: the reduction (started from the hooks with
    ``overlap_grad_reduce``, else after backward) and, with ``overlap_param_gather``, the gather. Nothing at
    dp = 1 (no data-parallel communication)."""
    layout = grads.layout
    if layout.dp == 1:
        return
    numel = bucket_numel(parallel.bucket_mb)
    overlap = parallel.overlap_grad_reduce
    grads.bucketed = BucketedReduce(layout, optimizer.dp_rank, numel, overlap=overlap,
                                    late=late_parameters(module) if overlap else set())
    if parallel.overlap_param_gather:
        optimizer.gather = BucketedGather(layout, optimizer.dp_rank, numel, module, grads.clock)
