"""Gradient and parameter buckets of the flat space, and one bucket's data-parallel collectives.

A bucket is a run of whole parameters of one region of the :class:`~megatier.optim.flat.FlatLayout` (dense, or
the routed experts'), about ``parallel.bucket_mb`` of fp32 gradient; the first and last bucket of a region reach
its ends, so the buckets tile the region, padding included. Ownership does not change: each dp rank still owns
its one contiguous range per region (what the checkpoint system saves and replays), so a bucket straddles the
ranges of one or more owners and its *piece* for each owner is the part inside that owner's range (maybe empty).
The bucket's collectives therefore move uneven pieces, with an all-to-all rather than a reduce-scatter:

- reduce: every rank sends each owner its piece of the bucket (divided by dp in place: the buffer is cleared
  before the next step anyway); the owner sums the dp rows *in dp rank order*. The sum of a piece is then a
  fixed function of the ranks' values, whatever the buckets, so any bucket size and either timing (during
  backward or after it) gives bitwise the same gradient shard. This is the only data-parallel gradient
  reduction (:mod:`megatier.optim.grad_buffer`): one reduce-scatter would sum in the order of its algorithm's
  ring segments, which differ with the bucket's bounds beyond dp = 2.
- gather: each owner sends its piece to every rank, which receives the pieces straight into the bucket's place
  in the parameter buffer. A copy: bitwise the one-collective all-gather.

Both are launched with ``async_op=True`` (gloo runs them on its own threads) and return the work to wait for.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatier.optim.flat import FlatLayout

DEFAULT_BUCKET_MB = 40.0  # parallel.bucket_mb=0 (Megatron-core's 40M-element buckets, roughly)


@dataclass(frozen=True)
class Bucket:
    """Flat range [lo, hi) of one region; ``pieces[q]`` = (start, end) of owner q's part (start == end: none);
    ``mine`` is this rank's index among the owners; ``shard_offset`` where this rank's piece starts in its
    optimizer shard; ``names`` the parameters whose segments it holds."""

    index: int
    region: int  # 0: dense (the dp group), 1: routed experts (the expert-data-parallel group)
    lo: int
    hi: int
    pieces: tuple[tuple[int, int], ...]
    mine: int
    shard_offset: int
    names: tuple[str, ...]

    @property
    def piece(self) -> tuple[int, int]:
        return self.pieces[self.mine]

    @property
    def piece_numel(self) -> int:
        lo, hi = self.piece
        return hi - lo

    def sizes(self) -> list[int]:
        return [hi - lo for lo, hi in self.pieces]


def bucket_numel(bucket_mb: float) -> int:
    """Elements of fp32 gradient in ``bucket_mb`` MiB (0: the default size)."""
    return max(1, int((bucket_mb or DEFAULT_BUCKET_MB) * (1 << 20)) // 4)


def plan_buckets(layout: FlatLayout, dp_rank: int, numel: int) -> list[Bucket]:
    """The buckets of every region of ``layout``, as seen from dp rank ``dp_rank``, dense region first, each
    region's in flat order. A bucket closes at the first parameter end at or past ``numel`` elements."""
    ranges = layout.shard_ranges(dp_rank)
    regions = [(0, layout.dense_numel, layout.dp, dp_rank)]
    if layout.expert_shard_size:
        regions.append((layout.dense_numel, layout.numel, layout.edp, dp_rank % layout.edp))
    buckets: list[Bucket] = []
    base = 0
    for region, ((start, end, owners, mine), (own_lo, own_hi)) in enumerate(zip(regions, ranges)):
        size = (end - start) // owners
        for lo, hi, names in _cuts(layout, start, end, numel):
            pieces = tuple((max(lo, start + q * size), max(max(lo, start + q * size), min(hi, start + (q + 1) * size)))
                           for q in range(owners))
            offset = base + pieces[mine][0] - own_lo
            buckets.append(Bucket(len(buckets), region, lo, hi, pieces, mine, offset, names))
        base += own_hi - own_lo
    return buckets


def _cuts(layout: FlatLayout, start: int, end: int, numel: int) -> list[tuple[int, int, tuple[str, ...]]]:
    """[lo, hi) ranges tiling [start, end) at parameter ends, each at least ``numel`` but the last."""
    out: list[tuple[int, int, tuple[str, ...]]] = []
    lo, names = start, []
    for s in layout.segments:
        if start <= s.offset < end:
            names.append(s.name)
            if s.end - lo >= numel:
                out.append((lo, s.end, tuple(names)))
                lo, names = s.end, []
    if names or not out:
        out.append((lo, end, tuple(names)))
    else:  # the region's padding joins its last bucket
        out[-1] = (out[-1][0], end, out[-1][2])
    return out


def launch_reduce(bucket: Bucket, grad_flat: torch.Tensor, dp: int,
                  group: Optional[dist.ProcessGroup]) -> tuple[torch.Tensor, Optional[dist.Work]]:
    """Start averaging ``bucket`` of ``grad_flat`` over ``group``: the receive buffer (owners x piece) and the
    work (None when the group is this rank alone). The bucket's part of the gradient buffer is divided by dp."""
    send = grad_flat[bucket.lo:bucket.hi].div_(dp)
    owners = len(bucket.pieces)
    if owners == 1:
        return send, None
    recv = torch.empty(owners * bucket.piece_numel, dtype=send.dtype, device=send.device)
    work = dist.all_to_all_single(recv, send, output_split_sizes=[bucket.piece_numel] * owners,
                                  input_split_sizes=bucket.sizes(), group=group, async_op=True)
    return recv, work


def sum_rows(bucket: Bucket, recv: torch.Tensor) -> torch.Tensor:
    """The owner's piece of the reduced bucket: the received rows summed in dp rank order."""
    owners = len(bucket.pieces)
    rows = recv.view(owners, bucket.piece_numel) if owners > 1 else recv.view(1, -1)
    total = rows[0].clone()
    for q in range(1, owners):
        total += rows[q]
    return total


def launch_gather(bucket: Bucket, param_flat: torch.Tensor, group: Optional[dist.ProcessGroup]) -> Optional[dist.Work]:
    """Start giving every owner's piece of ``bucket`` to every rank of ``group``, received in place in
    ``param_flat`` (this rank's own piece must already hold its new values); None when nothing moves."""
    owners = len(bucket.pieces)
    if owners == 1:
        return None
    lo, hi = bucket.piece
    send = param_flat[lo:hi].repeat(owners)
    return dist.all_to_all_single(param_flat[bucket.lo:bucket.hi], send, output_split_sizes=bucket.sizes(),
                                  input_split_sizes=[hi - lo] * owners, group=group, async_op=True)
