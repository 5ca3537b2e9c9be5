"""Canonical state: every element of an optimizer shard placed in its full, unpadded parameter tensor.

A ZeRO-1 shard is a contiguous range of one pipeline stage's flat buffer on one
tp rank. Its segment table (:class:`~megatier.optim.flat.ShardSegment`) and the
tp coordinates of the layout that wrote it say, for every element, which
parameter it belongs to and where it sits in that parameter's full tensor:

    segment element j  ->  element param_offset + j of this tp rank's slice (shape ``shape``)
    tp slice           ->  the padded full tensor, cut by ``shard_of_full(full, tp_dim, tp_stride, tp_rank, tp)``
    padded full        ->  the unpadded full tensor (``full_shape``): vocabulary padding adds rows
                           at the end of dim 0 only, so a padded row-major index is the unpadded one
                           below ``prod(full_shape)`` and padding above it

Nothing else is needed: not the model, not the config, not the old world.

The *canonical state* is ``{name: {kind: full tensor}}`` for kind in
:data:`STATE_KINDS`, keyed by the names of a pp=1 model (global layer indices,
so the same under every pp). A *copy* is not a name of its own: its segments
name their source (``ShardSegment.source``; ``head_weight``, the last stage's
copy of the tied word embedding when pp > 1, is ``word.weight``, and
CheckFree+'s replicas on the neighbouring stages are ``pos.weight`` and
``final_norm.*``), and each copy gets the same gradients as its source and
stays bitwise equal to it.

- :func:`shard_pieces` cuts one shard into pieces (name, full indices, values),
- :func:`assemble` puts the pieces of a set of shards together (and checks
  that they cover every element exactly),
- :func:`positions` says where a shard of any layout keeps each canonical
  element, :func:`select` cuts the pieces a shard needs (what a sender sends),
  :func:`place` fills a shard from pieces (checking it gets every element once),
- :func:`cut_shard` builds any layout's shard from the canonical state,
- :func:`reshard` is the composition: old-layout shards -> new-layout shards,
- :func:`canonical_digest` hashes the canonical state, equal under every layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import xxhash

from megatier.optim.flat import ShardSegment
from megatier.slicing import shard_of_full

STATE_KINDS = ("master", "exp_avg", "exp_avg_sq")


class ReshardError(ValueError):
    """Shards that cannot be placed in (or cut from) the canonical state; the message names what and the fix."""


def full_index(seg: ShardSegment, tp_rank: int, tp: int) -> torch.Tensor:
    """(seg.numel,) int64: each segment element's flat index in the unpadded full tensor, -1 in the padding."""
    if not seg.full_shape:
        raise ReshardError(f"segment {seg.name} records no full shape (written by a MegaTier before resharding); "
                           f"resume this checkpoint with the layout that wrote it")
    padded = list(seg.shape)
    if seg.tp_dim is not None:
        padded[seg.tp_dim] *= tp
    full = list(seg.full_shape)
    if len(padded) != len(full) or padded[1:] != full[1:] or padded[0] < full[0]:
        raise ReshardError(f"segment {seg.name}: tp slice {tuple(seg.shape)} at tp={tp} is not a slice of full "
                           f"shape {tuple(full)} (padding may only add rows); the segment table is corrupt")
    grid = torch.arange(math.prod(padded), dtype=torch.int64).view(padded)
    mine = shard_of_full(grid, seg.tp_dim, seg.tp_stride, tp_rank, tp).reshape(-1)
    index = mine[seg.param_offset:seg.param_offset + seg.numel]
    return torch.where(index < math.prod(full), index, torch.full_like(index, -1))


@dataclass
class Piece:
    """The part of one parameter's state that one shard holds: full indices and their values per kind."""

    name: str
    full_shape: tuple[int, ...]
    index: torch.Tensor  # (k,) int64 into the flattened unpadded full tensor
    values: dict[str, torch.Tensor]  # kind -> (k,) fp32


@dataclass
class ShardState:
    """One rank's shard as a checkpoint describes it: tp coordinates, segment table, flat state tensors."""

    tp_rank: int
    tp: int
    segments: list[ShardSegment]
    tensors: Mapping[str, torch.Tensor]  # kind -> (shard_size,) fp32


def shard_pieces(shard: ShardState, *, primary_only: bool = True, with_copies: bool = False) -> list[Piece]:
    """The shard's elements as pieces of canonical parameters, padding left out.

    ``primary_only``: skip elements another shard holds too (tp-replicated parameters on tp ranks > 0 and, unless
    ``with_copies``, the copies of another parameter), so a set of shards covering a model gives every element
    exactly once.
    """
    pieces = []
    for seg in shard.segments:
        copy = bool(seg.source) and not with_copies
        if primary_only and (copy or (seg.tp_dim is None and shard.tp_rank > 0)):
            continue
        index = full_index(seg, shard.tp_rank, shard.tp)
        keep = index >= 0
        values = {k: shard.tensors[k][seg.shard_offset:seg.shard_offset + seg.numel][keep] for k in STATE_KINDS}
        pieces.append(Piece(seg.canonical, tuple(seg.full_shape), index[keep], values))
    return pieces


def assemble(pieces: Sequence[Piece]) -> dict[str, dict[str, torch.Tensor]]:
    """The canonical state from pieces that cover every element of every named parameter exactly once."""
    shapes: dict[str, tuple[int, ...]] = {}
    for p in pieces:
        if shapes.setdefault(p.name, p.full_shape) != p.full_shape:
            raise ReshardError(f"{p.name} has full shape {p.full_shape} in one shard and {shapes[p.name]} in "
                               f"another; the shards belong to different models")
    state = {n: {k: torch.zeros(math.prod(s), dtype=torch.float32) for k in STATE_KINDS} for n, s in shapes.items()}
    counts = {n: torch.zeros(math.prod(s), dtype=torch.int32) for n, s in shapes.items()}
    for p in pieces:
        for k in STATE_KINDS:
            state[p.name][k][p.index] = p.values[k].float()
        counts[p.name].index_add_(0, p.index, torch.ones_like(p.index, dtype=torch.int32))
    for name, c in counts.items():
        missing, doubled = int((c == 0).sum()), int((c > 1).sum())
        if missing or doubled:
            raise ReshardError(f"the shards do not cover {name} exactly once ({missing} of {c.numel()} elements "
                               f"missing, {doubled} held twice); a rank's shard is missing or duplicated")
    return {n: {k: t.view(shapes[n]) for k, t in kinds.items()} for n, kinds in state.items()}


def positions(segments: Sequence[ShardSegment], tp_rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Canonical name -> (numel of the full tensor,) int64: where in this shard each element lives, -1 if not here.

    Dense over the full tensor, so a sender can cut exactly what this shard needs from any piece.
    """
    return _positions(segments, [full_index(seg, tp_rank, tp) for seg in segments])


def _positions(segments: Sequence[ShardSegment], indices: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """:func:`positions` from each segment's :func:`full_index`."""
    out: dict[str, torch.Tensor] = {}
    for seg, index in zip(segments, indices):
        keep = index >= 0
        pos = out.setdefault(seg.canonical,
                             torch.full((math.prod(seg.full_shape),), -1, dtype=torch.int64))
        pos[index[keep]] = seg.shard_offset + torch.nonzero(keep).squeeze(1)
    return out


def select(pieces: Sequence[Piece], where: Mapping[str, torch.Tensor]) -> list[Piece]:
    """The parts of ``pieces`` a shard with :func:`positions` ``where`` holds (its full indices kept)."""
    out = []
    for p in pieces:
        if p.name not in where:
            continue
        keep = where[p.name][p.index] >= 0
        if bool(keep.any()):
            out.append(Piece(p.name, p.full_shape, p.index[keep], {k: v[keep] for k, v in p.values.items()}))
    return out


def place(pieces: Sequence[Piece], segments: Sequence[ShardSegment], tp_rank: int, tp: int,
          shard_size: int) -> dict[str, torch.Tensor]:
    """A shard (kind -> (shard_size,) fp32) filled from pieces; every parameter element of the shard must be
    covered exactly once (padding elements stay zero). Elements the shard does not hold are ignored."""
    out = {k: torch.zeros(shard_size, dtype=torch.float32) for k in STATE_KINDS}
    hits = torch.zeros(shard_size, dtype=torch.int32)
    indices = [full_index(seg, tp_rank, tp) for seg in segments]
    where = _positions(segments, indices)
    shapes = {s.canonical: tuple(s.full_shape) for s in segments}
    for p in pieces:
        if p.name in shapes and p.full_shape != shapes[p.name]:
            raise ReshardError(f"{p.name} is {p.full_shape} in the checkpoint and {shapes[p.name]} in this model; "
                               f"it was written for another model shape")
        if p.name not in where:
            continue
        at = where[p.name][p.index]
        keep = at >= 0
        at = at[keep]
        for k in STATE_KINDS:
            out[k][at] = p.values[k][keep].float()
        hits.index_add_(0, at, torch.ones_like(at, dtype=torch.int32))
    for seg, index in zip(segments, indices):
        held = hits[seg.shard_offset:seg.shard_offset + seg.numel][index >= 0]
        if not bool((held == 1).all()):
            missing, doubled = int((held == 0).sum()), int((held > 1).sum())
            raise ReshardError(f"{seg.canonical}: {missing} of {held.numel()} elements of this shard "
                               f"are missing from the checkpoint and {doubled} came twice; a rank's shard is missing "
                               f"or the checkpoint was written for another model")
    return out


def whole_pieces(canonical: Mapping[str, Mapping[str, torch.Tensor]]) -> list[Piece]:
    """The canonical state as one piece per parameter."""
    return [Piece(name, tuple(kinds["master"].shape), torch.arange(kinds["master"].numel()),
                  {k: kinds[k].reshape(-1) for k in STATE_KINDS}) for name, kinds in canonical.items()]


def cut_shard(canonical: Mapping[str, Mapping[str, torch.Tensor]], segments: Sequence[ShardSegment], tp_rank: int,
              tp: int, shard_size: int) -> dict[str, torch.Tensor]:
    """One layout's shard (kind -> (shard_size,) fp32) from the canonical state; padding elements are zero."""
    return place(whole_pieces(canonical), segments, tp_rank, tp, shard_size)


def reshard(old: Sequence[ShardState], new: Sequence[tuple[int, int, Sequence[ShardSegment], int]]
            ) -> list[dict[str, torch.Tensor]]:
    """Old-layout shards (every rank's) -> the shards of ``new`` = [(tp_rank, tp, segments, shard_size)]."""
    pieces = [p for s in old for p in shard_pieces(s)]
    return [place(pieces, segs, tp_rank, tp, size) for tp_rank, tp, segs, size in new]


def canonical_digest(canonical: Mapping[str, Mapping[str, torch.Tensor]]) -> str:
    """xxh64 over master, exp_avg and exp_avg_sq of every parameter by name (sorted), unpadded, row-major."""
    h = xxhash.xxh64()
    for name in sorted(canonical):
        for kind in STATE_KINDS:
            t = canonical[name][kind].detach().to("cpu", torch.float32).contiguous()
            h.update(f"{name}/{kind}:{tuple(t.shape)};".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
