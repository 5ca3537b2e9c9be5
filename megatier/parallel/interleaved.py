"""The interleaved 1F1B schedule's order and its model chunks (``parallel.virtual_stages``).

With v virtual stages each of the P pipeline ranks holds v model chunks: chunk
c of rank p is virtual stage c * P + p, so a micro-batch visits every rank v
times and the pipeline bubble shrinks by v (Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM, arXiv 2104.04473). The order
is Megatron-core's: the n micro-batches of a rank become n * v virtual ones,
taken in groups of P * v; within a group, the first P go through chunk 0, the
next P through chunk 1, and so on, while backwards visit the chunks in reverse.
Rank p warms up with (P - p - 1) * 2 + (v - 1) * P forwards (at most n * v), then
alternates one forward and one backward, then cools down (megatron-core 0.16's
counts: no special case when n == P).

The order is a pure function of (P, p, v, n), so it is testable without a
process group; the schedule that runs it sends each chunk's output to the
next virtual stage. The layout's conditions live with the config's checks
(megatier.config.validation.check_interleaving).
"""
from __future__ import annotations

from typing import NamedTuple


class Op(NamedTuple):
    """One step of the order: ``kind`` "F" or "B", on model ``chunk``, for ``microbatch``."""
    kind: str
    chunk: int
    microbatch: int


def chunk_layers(*, num_layers: int, pp: int, virtual_stages: int, rank: int) -> list[range]:
    """The global layer indices of each model chunk of pipeline ``rank``: chunk c is virtual stage c * pp + rank."""
    per_chunk = num_layers // (pp * virtual_stages)
    starts = [(c * pp + rank) * per_chunk for c in range(virtual_stages)]
    return [range(s, s + per_chunk) for s in starts]


def warmup_count(*, pp: int, rank: int, virtual_stages: int, num_microbatches: int) -> int:
    """Forwards rank ``rank`` runs before its first backward."""
    return min((pp - rank - 1) * 2 + (virtual_stages - 1) * pp, num_microbatches * virtual_stages)


def _op(kind: str, k: int, *, pp: int, virtual_stages: int) -> Op:
    """The k-th virtual forward or backward: its chunk and real micro-batch."""
    group, in_group = divmod(k, pp * virtual_stages)
    chunk = in_group // pp
    if kind == "B":
        chunk = virtual_stages - 1 - chunk
    return Op(kind, chunk, group * pp + k % pp)


def interleaved_order(*, pp: int, rank: int, virtual_stages: int, num_microbatches: int) -> list[Op]:
    """Rank ``rank``'s forwards and backwards in the order it runs them."""
    total = num_microbatches * virtual_stages
    warmup = warmup_count(pp=pp, rank=rank, virtual_stages=virtual_stages, num_microbatches=num_microbatches)
    ops = [_op("F", k, pp=pp, virtual_stages=virtual_stages) for k in range(warmup)]
    for k in range(total - warmup):
        ops.append(_op("F", k + warmup, pp=pp, virtual_stages=virtual_stages))
        ops.append(_op("B", k, pp=pp, virtual_stages=virtual_stages))
    ops += [_op("B", k, pp=pp, virtual_stages=virtual_stages) for k in range(total - warmup, total)]
    return ops
