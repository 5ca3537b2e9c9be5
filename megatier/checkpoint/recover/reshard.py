"""Resharding restore: this job's shards rebuilt from units another layout wrote.

When the consensus point (V, E) was written by another layout (tp, pp, dp)
than the job's (a relaunch on other hardware, or on the surviving nodes
without a spare), restore runs the same cascade for the *old* layout's ranks,
then moves the state across layouts:

1. Assignment (:func:`assign`): each old rank is rebuilt by one rank of this
   job, preferably on a node whose memory holds that old rank's base (its reads
   stay local), at most ceil(old world / world) old ranks per rank; a rank
   rebuilding several does so one per *pass* (the cascade fetches one unit per
   rank per round).
2. Rebuild (:class:`Rebuilder`): the old rank's base V goes into a stand-alone
   shard described by the base's own segment table (:class:`OldShard`), and its
   chain V+1..E is replayed there with the same fused kernel as a same-layout
   restore (AdamW is elementwise, so a shard replays on its own).
3. Exchange (:func:`exchange`): the rebuilt shards are cut into canonical
   pieces (:mod:`megatier.optim.canonical`); every rank tells every other the
   segment table of its new shard, and each rebuilding rank sends each rank
   exactly the elements that rank holds, point to point in one global order
   (as the cascade's transfers: the lowest unfinished pair always has both ends
   ready). Each rank then places what it got into its shard, checking that every
   element came exactly once. The scalars (Adam step count, loss scaler) come
   from the rebuilt old shards, which all agree on them.

Data position and LR schedule are functions of the step (E), so they carry over
by themselves; a global batch the new dp cannot divide is a config error before
any of this runs.
"""
from __future__ import annotations

import copy
import io
import math
from typing import Callable, Optional, Sequence

import torch

from megatier.checkpoint.comm import CheckpointComm
from megatier.checkpoint.format.payload import BaseState, DiffStep
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.recover.consensus import Consensus
from megatier.checkpoint.recover.inventory import raise_fatal
from megatier.checkpoint.shard import ShardAccess
from megatier.checkpoint.tiers.base import TIER1
from megatier.optim.canonical import Piece, ShardState, place, positions, select, shard_pieces
from megatier.optim.flat import ShardSegment, ranges_tensor
from megatier.parallel.layout import Layout, layout_str


def reshard_label(old: Sequence[int], new: Sequence[int]) -> str:
    """``(2,2,1) -> (1,1,4)``: (tp,pp,dp) before and after, for the recovery record."""
    return "({},{},{}) -> ({},{},{})".format(*old, *new)


def assign(consensus: Consensus, rank_nodes: Sequence[str]) -> list[dict[int, int]]:
    """Passes of {rank of this job: old rank it rebuilds}; every old rank exactly once."""
    world, old_world = len(rank_nodes), math.prod(consensus.degrees)
    cap = -(-old_world // world)
    load = [0] * world
    passes: list[dict[int, int]] = []
    base = PayloadId.base(consensus.version)
    for old in range(old_world):
        homes = {c.node for c in consensus.copies[(old, base)] if c.tier == TIER1 and not c.replica}
        local = [r for r in range(world) if rank_nodes[r] in homes and load[r] < cap]
        rank = min(local or [r for r in range(world) if load[r] < cap], key=lambda r: (load[r], r))
        if load[rank] == len(passes):
            passes.append({})
        passes[load[rank]][rank] = old
        load[rank] += 1
    return passes


class OldShard:
    """An old layout's optimizer shard outside any model: what :class:`ShardAccess` needs to load a base and
    replay diffs (the attributes of DistributedAdamW that it reads)."""

    def __init__(self, base: BaseState, optimizer):
        self.cfg = optimizer.cfg
        self.master, self.exp_avg, self.exp_avg_sq = base.master, base.exp_avg, base.exp_avg_sq
        self.shard_segments = [ShardSegment.from_dict(d) for d in base.segments]
        self.decay_ranges = ranges_tensor(self.shard_segments, "decay")
        self.adam_steps = base.adam_steps
        self.scaler = None
        if optimizer.scaler is not None and base.loss_scaler is not None:
            self.scaler = copy.deepcopy(optimizer.scaler)
            self.scaler.load_state_dict(base.loss_scaler)


class Rebuilder:
    """The old shards this rank rebuilds, by old rank: restore's rounds apply units here while resharding
    (``current``: the old rank of the running pass)."""

    def __init__(self, optimizer, global_batch_size: int, layout_of: Callable[[int], Layout]):
        self.optimizer = optimizer
        self.global_batch_size = global_batch_size
        self.layout_of = layout_of
        self.shards: dict[int, tuple[Layout, ShardAccess]] = {}  # old rank -> (its layout, access)
        self.current: Optional[int] = None

    def load_base(self, base: BaseState) -> None:
        self.shards[self.current] = (self.layout_of(self.current),
                                     ShardAccess(OldShard(base, self.optimizer), self.global_batch_size))

    def replay(self, steps: Sequence[DiffStep]) -> None:
        self.shards[self.current][1].replay(steps)

    def rebuilt(self) -> list[ShardState]:
        return [ShardState(layout.tp_rank, layout.tp, a.optimizer.shard_segments,
                           {k: getattr(a.optimizer, k) for k in ("master", "exp_avg", "exp_avg_sq")})
                for layout, a in self.shards.values()]

    def scalars(self) -> Optional[tuple[int, Optional[dict]]]:
        """(Adam step count, loss-scaler state) after the replay, or None if this rank rebuilt nothing."""
        for _, a in self.shards.values():
            o = a.optimizer
            return o.adam_steps, (o.scaler.state_dict() if o.scaler is not None else None)
        return None


def pack_pieces(pieces: list[Piece]) -> bytes:
    """Pieces as bytes for a point-to-point transfer (:func:`unpack_pieces` reads them back)."""
    buf = io.BytesIO()
    torch.save([(p.name, p.full_shape, p.index, p.values) for p in pieces], buf)
    return buf.getvalue()


def unpack_pieces(data: Optional[bytes]) -> list[Piece]:
    if data is None:
        return []
    return [Piece(*fields) for fields in torch.load(io.BytesIO(data), weights_only=True)]


def exchange(comm: CheckpointComm, rebuilder: Rebuilder, shard: ShardAccess, tp_rank: int, tp: int,
             what: str) -> None:
    """Move the rebuilt old shards' elements to the ranks that hold them now and install them (module docstring,
    step 3); collective. Any failure becomes the same error on every rank."""
    o = shard.optimizer
    mine = list(o.shard_segments)
    pieces: list[Piece] = []
    fatal = None
    try:
        pieces = [p for s in rebuilder.rebuilt() for p in shard_pieces(s)]
    except ValueError as e:  # a segment table that cannot be placed (ReshardError)
        fatal = str(e)
    tables = comm.gather({"segments": [s.to_dict() for s in mine], "tp": (tp_rank, tp), "holds": bool(pieces),
                          "scalars": rebuilder.scalars(), "fatal": fatal}, what=f"{what} (segment tables)")
    raise_fatal(tables, what)
    received: list[Piece] = []
    try:
        for src in (r for r in range(comm.world_size) if tables[r]["holds"]):
            for dst in range(comm.world_size):
                if comm.rank not in (src, dst):
                    continue
                if src == dst:
                    received += select(pieces, positions(mine, tp_rank, tp))
                elif comm.rank == src:
                    segs = [ShardSegment.from_dict(d) for d in tables[dst]["segments"]]
                    comm.send(pack_pieces(select(pieces, positions(segs, *tables[dst]["tp"]))), dst)
                else:
                    received += unpack_pieces(comm.recv(src))
        steps, scaler = next(t["scalars"] for t in tables if t["scalars"] is not None)
        tensors = place(received, mine, tp_rank, tp, o.master.numel())
        shard.load_state(tensors, steps, scaler, what)
    except Exception as e:  # a transfer, a shard the pieces do not cover, a shape: fatal on every rank
        fatal = f"{type(e).__name__}: {e}"
    raise_fatal(comm.gather({"fatal": fatal}, what=f"the end of {what}"), what)


def describe(consensus: Consensus, degrees: Sequence[int]) -> str:
    """``resharding tp=2 pp=2 dp=1 -> tp=1 pp=1 dp=4``, for messages."""
    return f"resharding {layout_str(consensus.degrees)} -> {layout_str(tuple(degrees))}"
