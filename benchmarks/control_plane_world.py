"""The world the control-plane simulation recovers (benchmarks/bench_control_plane.py): its layout, the
inventory its ranks leave in node memory and Tier-3, and the figures' helpers.

tp 8 (one node of 8 ranks), pp 16, dp the rest; every rank has 2 bases (steps 0 and 50) and a 50-step chain
after the newer one (diff batches of ``batch`` steps) in its node's memory (Tier-1) and in its ring
successor's (Tier-2); Tier-3 holds the bases and every batch but the newest. Node ``lost`` lost its memory; a
spare node runs its ranks.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

from megatier.checkpoint.format.payload import Stamp
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.tiers.base import JOB, NODE, TIER1, TIER2, TIER3, Copy, Listing
from megatier.parallel.layout import Layout, coordinates_of

TP, PP, PER_NODE = 8, 16, 8
JOB_ID = b"gpt-llama-70b"
FINGERPRINT = b"3f9a0c2d11e4b7a5"
TIERS = [SimpleNamespace(label=TIER1, scope=NODE), SimpleNamespace(label=TIER2, scope=NODE),
         SimpleNamespace(label=TIER3, scope=JOB, where=lambda: "s3://bucket/job")]


@dataclass
class World:
    ranks: int
    batch: int
    lost: int = 1  # the node whose memory is gone

    @property
    def dp(self) -> int:
        return self.ranks // (TP * PP)

    @property
    def nodes(self) -> int:
        return self.ranks // PER_NODE

    def units(self, tier3: bool = False) -> list[PayloadId]:
        """A rank's units: bases 0 and 50, then the diff batches of steps 51..100 (Tier-3 lacks the newest)."""
        diffs = [PayloadId.diff(first, min(first + self.batch - 1, 100)) for first in range(51, 101, self.batch)]
        return [PayloadId.base(0), PayloadId.base(50), *(diffs[:-1] if tier3 else diffs)]

    def node_of(self, rank: int) -> str:
        node = rank // PER_NODE
        return "spare0" if node == self.lost else f"node{node}"


def stamps(world: World, rank: int, pids: list[PayloadId]) -> list[Stamp]:
    """Stamps as a tier reads them from their files: each its own strings (so pickling shares nothing)."""
    tp_rank, dp_rank, pp_rank = coordinates_of(rank, tp=TP, dp=world.dp)
    layout = Layout(TP, PP, world.dp, tp_rank, pp_rank, dp_rank)
    return [Stamp(p, 1 << 20, f"{(rank * 7919 + p.last) & 0xFFFFFFFFFFFFFFFF:016x}", JOB_ID.decode(), layout,
                  FINGERPRINT.decode()) for p in pids]


def node_listings(world: World, node: int) -> dict[str, Listing]:
    """What node ``node``'s memory lists: its ranks' units (Tier-1) and its ring predecessor's (Tier-2)."""
    name = f"node{node}"
    if node == world.lost:
        return {TIER1: Listing(), TIER2: Listing()}
    own = range(node * PER_NODE, (node + 1) * PER_NODE)
    pred = (node - 1) % world.nodes
    replicas = range(pred * PER_NODE, (pred + 1) * PER_NODE)  # the lost node's own replicas survive here
    t1 = [Copy(s, TIER1, name) for r in own for s in stamps(world, r, world.units())]
    t2 = [Copy(s, TIER2, name) for r in replicas for s in stamps(world, r, world.units())]
    return {TIER1: Listing(copies=t1, traces=True, progress={r: 100 for r in own}),
            TIER2: Listing(copies=t2, traces=bool(t2))}


def cpu(fn: Callable):
    start = time.process_time()
    out = fn()
    return out, time.process_time() - start


def padded(sizes: list[int]) -> int:
    """Bytes an object collective of items of ``sizes`` moves to one receiver: torch pads each to the largest."""
    return len(sizes) * max(sizes)
