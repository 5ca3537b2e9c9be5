"""Flat contiguous parameter storage and its segment table.

All parameters of a model stage live in one flat tensor; each ``nn.Parameter``
is a view into it. The segment table says where each parameter lives. The
ZeRO-1 optimizer cuts the flat space into dp shards (a routed expert's
parameters over their own expert-data-parallel group: :class:`FlatLayout`), and
the checkpoint system saves and replays exactly those shards, so this table is
the contract between them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Iterable, NamedTuple, Optional

import torch
from torch import nn


@dataclass(frozen=True)
class Segment:
    """One parameter's place in the flat buffer.

    ``decay``: receives weight decay (matrices and embeddings, not biases/norms).
    ``in_norm``: counted in the global grad norm on this rank; False for copies
    that another rank already counts (tp-replicated params on tp ranks > 0, the
    last stage's copy of the tied embedding).
    ``tp_dim`` / ``tp_stride``: how the full tensor is cut across tp ranks
    (:func:`megatier.slicing.shard_of_full`; dim None: replicated).
    ``full_shape``: the full, unsharded tensor without vocabulary padding;
    ``shape`` is this tp rank's slice of the padded full tensor. Together with
    the layout's tp coordinates they place every element in the full tensor
    (:mod:`megatier.optim.canonical`).
    ``source``: the parameter this one is a copy of (the tied head of a later
    stage, CheckFree+'s replicas; ``megatier.model.params.copies_of``), "" for a
    parameter of its own. A copy is trained like its source and counted once.
    """

    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]
    decay: bool
    in_norm: bool
    tp_dim: Optional[int] = None
    tp_stride: int = 1
    full_shape: tuple[int, ...] = ()
    source: str = ""

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class ShardSegment:
    """The part of a parameter that falls in one dp shard.

    ``shard_offset`` is relative to the shard start; ``param_offset`` is the
    element offset inside the flattened parameter where this part begins.
    """

    name: str
    shard_offset: int
    param_offset: int
    numel: int
    shape: tuple[int, ...]
    decay: bool
    in_norm: bool
    tp_dim: Optional[int] = None
    tp_stride: int = 1
    full_shape: tuple[int, ...] = ()  # (): written before segment tables carried it (not reshardable)
    source: str = ""  # the parameter this one copies ("" for its own; see Segment)

    @property
    def canonical(self) -> str:
        """The name of the parameter whose elements this segment holds: its source, or its own name."""
        return self.source or self.name

    def to_dict(self) -> dict:
        """Its fields by name (every value a scalar or a tuple of ints, so no deep copy: ``asdict``'s recursion
        costs about ten times as much, in the loop, at every base)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> "ShardSegment":
        """The inverse of :meth:`to_dict` (tuples come back from JSON as lists)."""
        values = dict(d)
        for key in ("shape", "full_shape"):
            values[key] = tuple(values.get(key, ()))
        return cls(**values)


class ParamSpec(NamedTuple):
    """A parameter without its tensor: this tp rank's ``shape``, how the full tensor is cut (``tp_dim`` None:
    replicated) and the full unpadded shape; what a segment is made of."""

    name: str
    shape: tuple[int, ...]
    tp_dim: Optional[int]
    tp_stride: int
    full_shape: tuple[int, ...]
    source: str = ""  # the parameter this one copies (see Segment)
    expert: int = -1  # the global index of the routed expert it belongs to (model.moe), -1: a dense parameter


class FlatLayout:
    """Segment table of a model stage, padded so each region divides into its shards.

    Two regions, each rank's shard being its part of both, in that order:

    - dense: every parameter that is not a routed expert's, cut into dp equal shards;
    - experts (``model.moe``): this rank's experts, expert by expert in global index order, each expert's
      parameters (of every layer of the stage) padded to a multiple of dp, cut into dp / ep equal shards over
      the expert-data-parallel group (the dp ranks holding the same experts, ``parallel.ep``).

    Data-parallel rank d is (ep rank d // (dp / ep), expert-dp rank d % (dp / ep)) (megatier.parallel.state), so
    its expert shard covers the same expert elements under every ep that divides dp: ep=1 lays the experts out
    as ep > 1 does, and a shard (its segment table, its bytes) does not depend on ep. Without experts the
    layout is the dense region alone.
    """

    def __init__(self, segments: list[Segment], dp: int, *, dense_numel: Optional[int] = None, ep: int = 1):
        self.segments = segments
        used = max((s.end for s in segments), default=0)
        self.dp, self.ep, self.edp = dp, ep, dp // ep
        self.dense_numel = dense_numel if dense_numel is not None else -(-used // dp) * dp
        # each expert starts at a multiple of dp: padded to one, the region divides into dp / ep shards
        expert_numel = -(-(used - self.dense_numel) // dp) * dp if dense_numel is not None else 0
        self.expert_shard_size = expert_numel // self.edp
        self.shard_size = self.dense_numel // dp + self.expert_shard_size
        self.numel = self.dense_numel + expert_numel  # padding is never read by a parameter

    @classmethod
    def from_module(cls, module: nn.Module, dp: int, *, tp_rank: int, ep: int = 1) -> "FlatLayout":
        """The layout of a module's parameters, as they describe themselves (``tp_partition_dim`` and
        ``_stride``, ``full_shape``, ``copy_of``, ``expert_index``)."""
        params = [ParamSpec(name, tuple(p.shape), p.tp_partition_dim, getattr(p, "tp_partition_stride", 1),
                            tuple(getattr(p, "full_shape", p.shape if p.tp_partition_dim is None else ())),
                            getattr(p, "copy_of", ""), getattr(p, "expert_index", -1))
                  for name, p in module.named_parameters()]
        return cls.from_params(params, dp, tp_rank=tp_rank, ep=ep)

    @classmethod
    def from_params(cls, params: Iterable[ParamSpec], dp: int, *, tp_rank: int, ep: int = 1) -> "FlatLayout":
        """The layout of parameters: dense ones in their order, then the experts' (class docstring); a module's,
        or a stage's described without building it (``megatier.model.params.stage_parameters``, for a size
        plan)."""
        params = list(params)
        dense = [p for p in params if p.expert < 0]
        segments = _segments(dense, 0, tp_rank)
        experts = sorted({p.expert for p in params if p.expert >= 0})
        if not experts:
            return cls(segments, dp)
        offset = -(-(segments[-1].end if segments else 0) // dp) * dp
        dense_numel = offset
        for e in experts:
            block = _segments([p for p in params if p.expert == e], offset, tp_rank)
            segments += block
            offset = -(-block[-1].end // dp) * dp
        return cls(segments, dp, dense_numel=dense_numel, ep=ep)

    def shard_ranges(self, dp_rank: int) -> list[tuple[int, int]]:
        """The flat ranges [start, end) shard ``dp_rank`` holds, in shard order: its dense part, then its expert
        part (if the stage has experts)."""
        dense = self.dense_numel // self.dp
        out = [(dp_rank * dense, (dp_rank + 1) * dense)]
        if self.expert_shard_size:
            start = self.dense_numel + (dp_rank % self.edp) * self.expert_shard_size
            out.append((start, start + self.expert_shard_size))
        return out

    def shard_range(self, dp_rank: int) -> tuple[int, int]:
        """The one flat range of shard ``dp_rank`` of a stage without experts."""
        ranges = self.shard_ranges(dp_rank)
        if len(ranges) != 1:
            raise ValueError("a stage with experts has two ranges per shard; use shard_ranges")
        return ranges[0]

    def shard_segments(self, dp_rank: int) -> list[ShardSegment]:
        """Segments intersecting shard ``dp_rank``, clipped to it; together they tile its used part."""
        out, base = [], 0
        for lo, hi in self.shard_ranges(dp_rank):
            for s in self.segments:
                start, end = max(s.offset, lo), min(s.end, hi)
                if start < end:
                    out.append(ShardSegment(s.name, base + start - lo, start - s.offset, end - start, s.shape,
                                            s.decay, s.in_norm, s.tp_dim, s.tp_stride, s.full_shape, s.source))
            base += hi - lo
        return out


def _segments(params: list[ParamSpec], offset: int, tp_rank: int) -> list[Segment]:
    """Consecutive segments of ``params`` from ``offset``."""
    out = []
    for p in params:
        replicated = p.tp_dim is None
        in_norm = not (replicated and tp_rank > 0) and not p.source
        numel = math.prod(p.shape)
        out.append(Segment(p.name, offset, numel, p.shape, decay=len(p.shape) >= 2, in_norm=in_norm,
                           tp_dim=p.tp_dim, tp_stride=p.tp_stride, full_shape=p.full_shape, source=p.source))
        offset += numel
    return out


def flatten_parameters(module: nn.Module, layout: FlatLayout, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Move every parameter into one flat buffer of ``dtype`` and make each a view of it."""
    flat = torch.zeros(layout.numel, dtype=dtype, device=device)
    params = dict(module.named_parameters())
    for s in layout.segments:
        p = params[s.name]
        view = flat[s.offset:s.end].view(s.shape)
        view.copy_(p.detach())
        p.data = view
    return flat


def ranges_tensor(segments: list[ShardSegment], attr: str) -> torch.Tensor:
    """(k, 2) int64 [start, end) shard ranges of the segments whose flag ``attr`` is set, merged when adjacent."""
    ranges: list[list[int]] = []
    for s in segments:
        if not getattr(s, attr):
            continue
        if ranges and ranges[-1][1] == s.shard_offset:
            ranges[-1][1] += s.numel
        else:
            ranges.append([s.shard_offset, s.shard_offset + s.numel])
    return torch.tensor(ranges, dtype=torch.int64).reshape(-1, 2)
