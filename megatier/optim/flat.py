"""Flat contiguous parameter storage and its segment table.

All parameters of a model stage live in one flat tensor; each ``nn.Parameter``
is a view into it. The segment table says where each parameter lives. The
ZeRO-1 optimizer cuts the flat space into dp equal shards, and the checkpoint
system saves and replays exactly those shards, so this table is the contract
between them.
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


class FlatLayout:
    """Segment table of a model stage, padded so the flat size divides into dp shards."""

    def __init__(self, segments: list[Segment], dp: int):
        self.segments = segments
        used = segments[-1].end if segments else 0
        self.shard_size = (used + dp - 1) // dp
        self.numel = self.shard_size * dp  # padding at the end is never read by a parameter
        self.dp = dp

    @classmethod
    def from_module(cls, module: nn.Module, dp: int, *, tp_rank: int) -> "FlatLayout":
        """The layout of a module's parameters, as they describe themselves (``tp_partition_dim`` and
        ``_stride``, ``full_shape``, ``copy_of``)."""
        params = [ParamSpec(name, tuple(p.shape), p.tp_partition_dim, getattr(p, "tp_partition_stride", 1),
                            tuple(getattr(p, "full_shape", p.shape if p.tp_partition_dim is None else ())),
                            getattr(p, "copy_of", ""))
                  for name, p in module.named_parameters()]
        return cls.from_params(params, dp, tp_rank=tp_rank)

    @classmethod
    def from_params(cls, params: Iterable[ParamSpec], dp: int, *, tp_rank: int) -> "FlatLayout":
        """The layout of parameters in flat order: a module's, or a stage's described without building it
        (``megatier.model.params.stage_parameters``, for a size plan)."""
        segments, offset = [], 0
        for p in params:
            replicated = p.tp_dim is None
            in_norm = not (replicated and tp_rank > 0) and not p.source
            numel = math.prod(p.shape)
            segments.append(Segment(p.name, offset, numel, p.shape, decay=len(p.shape) >= 2, in_norm=in_norm,
                                    tp_dim=p.tp_dim, tp_stride=p.tp_stride, full_shape=p.full_shape,
                                    source=p.source))
            offset += numel
        return cls(segments, dp)

    def shard_range(self, dp_rank: int) -> tuple[int, int]:
        start = dp_rank * self.shard_size
        return start, start + self.shard_size

    def shard_segments(self, dp_rank: int) -> list[ShardSegment]:
        """Segments intersecting shard ``dp_rank``, clipped to it; together they tile its used part."""
        lo, hi = self.shard_range(dp_rank)
        out = []
        for s in self.segments:
            start, end = max(s.offset, lo), min(s.end, hi)
            if start < end:
                out.append(ShardSegment(s.name, start - lo, start - s.offset, end - start, s.shape, s.decay,
                                        s.in_norm, s.tp_dim, s.tp_stride, s.full_shape, s.source))
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
