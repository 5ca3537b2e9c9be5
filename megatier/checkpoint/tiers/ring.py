"""Tier-2 ring transfers, the data side: pacing plan, legs and ticks (used by :mod:`.replicator`).

A *leg* is one direction of one unit between two ring neighbours, cut into
chunks; chunk k of a leg moves at the first tick at or after its due step. A
diff batch or step unit is one chunk, due at once. A base at step v is handed over at v + 1
and paced from v + 2 on (:func:`chunk_plan`): L = max(sender size, receiver
size), T = max(1, base_interval - 2 - margin) (the steps from v + 2 to the next
base, less margin = max(1, base_interval // 5)), chunk = min(ceil(L / T),
max_chunk_bytes), and chunk k of the sender's n is due at v + 2 + floor(k * T
/ n): the last at v + base_interval - 1 - margin at the latest, so the replica
is whole a margin before the next base. Both ends compute the same plan, so
the receiver posts exactly the receives the sender sends. When the cap binds,
several chunks fall into one step; T < base_interval leaves the margin for a
slow peer.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from megatier.checkpoint.format.payload import EncodedPayload, Stamp
from megatier.checkpoint.format.units import BASE, DIFF, STEP, PayloadId
from megatier.checkpoint.tiers.node_memory import ReplicaWriter

SLOTS = (DIFF, BASE)  # header table rows, and the order of units within a tick (a step unit uses the diff slot)
KIND_CODES = (DIFF, BASE, STEP)  # a unit's kind as an integer in the acks


def chunk_plan(size: int, other_size: int, base_interval: int, max_chunk_bytes: int) -> tuple[int, int, int]:
    """(chunk bytes, chunk count, steps T) of a paced base of ``size`` bytes; the larger payload sets the pace.

    T counts from the first chunk's tick, two steps after the base's version
    (hand-off at v + 1, chunks from v + 2), so the margin is really left before
    the next base: a node failure late in the interval finds the replica whole.
    """
    span = max(1, base_interval - 2 - max(1, base_interval // 5))
    chunk = max(1, min(math.ceil(max(size, other_size) / span), max_chunk_bytes))
    return chunk, max(1, math.ceil(size / chunk)), span


@dataclass(frozen=True)
class PeerStatus:
    """A snapshot for metrics and tests."""

    pending_bytes: int  # own payload bytes handed in and not yet sent
    acked_units: dict  # kind (diff, base, step) -> newest PayloadId the holder confirmed complete (or None)
    received: tuple  # owner's units completed here, oldest first (the most recent 256)
    last_error: Optional[str]
    sync_flushes: int = 0  # ticks at which a new base forced the previous one out (spills)
    base_chunks: tuple = ()  # (base version, step, chunks sent at that step) of recent own bases


@dataclass
class Leg:
    """One direction of one unit: ``n`` chunks of ``chunk`` bytes; chunk k due at ``start + k * span // n``."""

    pid: PayloadId
    size: int
    chunk: int
    n: int
    start: int
    span: int
    data: Optional[bytes] = None  # outgoing: the payload
    stamp: Optional[Stamp] = None  # incoming: what it must verify against
    writer: Optional[ReplicaWriter] = None  # incoming base
    parts: list = field(default_factory=list)  # incoming diff
    base_index: int = -1  # the how-many-th base (bases only)
    done: int = 0  # chunks moved
    forced: bool = False
    bad: Optional[str] = None  # incoming: why the copy was discarded

    def due(self, tick: int) -> range:
        k = self.n if self.forced else self.done
        while k < self.n and self.start + k * self.span // self.n <= tick:
            k += 1
        return range(self.done, k)

    def bounds(self, k: int) -> tuple[int, int]:
        return k * self.chunk, min((k + 1) * self.chunk, self.size)


@dataclass(frozen=True)
class Tick:
    step: int
    diff: Optional[EncodedPayload] = None
    base: Optional[EncodedPayload] = None
    flush: bool = False


class TransferError(RuntimeError):
    """A Tier-2 transfer failed or the peers disagree; it stops the replicator."""
