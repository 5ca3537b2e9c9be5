"""CheckFree (002_*.txt, section 4.2): a pipeline stage lost from every tier, rebuilt from its two neighbours.

The last resort of ``checkpoint.last_resort=checkfree``. Consensus found stages
none of whose ranks holds a base anywhere and agreed V and E among the other
ranks (:func:`.consensus.agree_without_lost`); those restored to E as usual.
Then, collectively, before the parameters are published (:func:`rebuild`):

1. Every rank tells every other its stage, the transformer layers its shard
   holds, its part of the squared norm of step E's gradient (recorded with
   every diff step and base) and its loss scaler.
2. Stage j's weight w_j is its squared gradient norm at E: the sum of its ranks'
   parts (each element counted on one rank). A lost stage and its neighbours
   must hold the same number of transformer layers (:func:`plan`).
3. Each rank of stage i-1 and i+1 cuts its shard into canonical pieces
   (:mod:`megatier.optim.canonical`), keeps its transformer layers, renames
   them to stage i's (the k-th layer of one stage stands for the k-th of the
   other) and sends each rank of stage i exactly the elements that rank holds,
   point to point in one global order (as the resharding exchange: the lowest
   unfinished pair always has both ends ready).
4. Each rank of stage i places each neighbour's pieces into a shard of its own
   layout (every element exactly once) and takes, element by element and per
   tp rank (:func:`mix`),

       W_i = (w_{i-1} W_{i-1} + w_{i+1} W_{i+1}) / (w_{i-1} + w_{i+1}).

   Its Adam moments start at zero and its Adam count at 0 (the bias correction
   of a fresh optimizer, matching the zero moments), its lr is the schedule's
   times ``checkfree.lr_scale`` from now on (kept in its bases), its loss
   scaler is the neighbours'.

Training goes on at E + 1 on every stage, without a rollback. The result is
not exact, and the run says so: every rank records E as ``inexact_since`` (kept
in every base it writes; the step metrics carry it) and the recovery record
names the stage, its neighbours, the weights and ``exact: false``.
``checkfree.init`` = ``copy`` (stage i-1 copied) or ``random`` (the stage keeps
the GPT-2 initialisation its launch drew) are the paper's Figure 2 baselines.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from megatier.checkpoint.context import CheckpointContext
from megatier.checkpoint.recover.consensus import Consensus, stage_of
from megatier.checkpoint.recover.inventory import RecoveryError, raise_fatal
from megatier.checkpoint.recover.reshard import pack_pieces, unpack_pieces
from megatier.checkpoint.shard import ShardAccess
from megatier.optim.canonical import Piece, ShardState, place, positions, select, shard_pieces
from megatier.optim.flat import ShardSegment

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def layers_of(names: Sequence[str]) -> list[int]:
    """The global indices of the transformer layers among parameter names (``layers.<i>.<rest>``)."""
    return sorted({int(m.group(1)) for n in names if (m := _LAYER.match(n))})


@dataclass(frozen=True)
class StageRebuild:
    """How one lost stage is rebuilt: from ``sources`` (stage, weight), each source's layers renamed to the
    lost stage's by ``renames[k]`` (global layer index there -> here)."""

    stage: int
    sources: tuple[tuple[int, float], ...]
    renames: tuple[dict[int, int], ...]

    def describe(self) -> dict:
        return {"stage": self.stage, "neighbours": [s for s, _ in self.sources],
                "weights": [w for _, w in self.sources]}


def stage_sumsq(parts: Sequence[Optional[float]], degrees: tuple[int, int, int]) -> list[Optional[float]]:
    """Each stage's squared gradient norm from its ranks' parts (None when some rank's part is unknown)."""
    total: list[Optional[float]] = [0.0] * degrees[1]
    for rank, part in enumerate(parts):
        s = stage_of(rank, degrees)
        total[s] = None if part is None or total[s] is None else total[s] + part
    return total


def plan(lost: Sequence[int], stage_layers: Sequence[list[int]], sumsq: Sequence[Optional[float]], end: int,
         init: str) -> list[StageRebuild]:
    """The rebuild of every lost stage (pure; every rank computes the same); RecoveryError naming the stage when
    it cannot be done. ``stage_layers[j]``: stage j's layer indices; ``sumsq[j]``: its squared gradient norm at
    ``end``; ``init``: weighted (both neighbours), copy (the previous one), random (none)."""
    out = []
    for i in lost:
        sides = {"weighted": (i - 1, i + 1), "copy": (i - 1,), "random": ()}[init]
        for j in (i - 1, i + 1):
            if len(stage_layers[j]) != len(stage_layers[i]):
                raise RecoveryError(
                    f"refusing CheckFree for stage {i}: it holds {len(stage_layers[i])} transformer layers and its "
                    f"neighbour stage {j} {len(stage_layers[j])}; CheckFree needs stages of identical shape "
                    f"(model.num_layers divisible by parallel.pp)")
        weights = []
        for j in sides:
            if sumsq[j] is None:
                raise RecoveryError(
                    f"refusing CheckFree for stage {i}: the last gradient norm of its neighbour stage {j} is not "
                    f"recorded at step {end} (units written before MegaTier recorded it); restore stage {i}'s "
                    f"units instead")
            weights.append(sumsq[j] if init == "weighted" else 1.0)
        renames = tuple(dict(zip(stage_layers[j], stage_layers[i])) for j in sides)
        out.append(StageRebuild(i, tuple(zip(sides, weights)), renames))
    return out


def mix(tensors: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """sum_k w_k t_k / sum_k w_k, in float64, rounded once to float32 (equal weights when they sum to 0)."""
    if sum(weights) <= 0.0:
        weights = [1.0] * len(weights)
    acc = torch.zeros_like(tensors[0], dtype=torch.float64)
    for t, w in zip(tensors, weights):
        acc += w * t.double()
    return (acc / sum(weights)).float()


def _renamed(pieces: list[Piece], rename: dict[int, int]) -> list[Piece]:
    """The pieces of transformer layers, named as the layers of the lost stage they stand for."""
    out = []
    for p in pieces:
        m = _LAYER.match(p.name)
        if m is not None:
            out.append(Piece(f"layers.{rename[int(m.group(1))]}.{m.group(2)}", p.full_shape, p.index, p.values))
    return out


def _exchange(ctx: CheckpointContext, shard: ShardAccess, rebuilds: list[StageRebuild], tables: list[dict]
              ) -> dict[int, list[Piece]]:
    """Send every lost rank its elements of each source stage, in one global order; returns what this rank got
    from each source stage (empty on other ranks)."""
    o, me, degrees = shard.optimizer, ctx.rank, ctx.layout.degrees
    tp_rank, tp = ctx.layout.tp_rank, ctx.layout.tp
    ranks = range(ctx.comm.world_size)
    mine: list[Piece] = []
    got: dict[int, list[Piece]] = {}
    for rb in rebuilds:
        for (source, _), rename in zip(rb.sources, rb.renames):
            for src in (r for r in ranks if stage_of(r, degrees) == source):
                if src == me and not mine:
                    tensors = {k: getattr(o, k) for k in ("master", "exp_avg", "exp_avg_sq")}
                    mine = shard_pieces(ShardState(tp_rank, tp, o.shard_segments, tensors))
                for dst in (r for r in ranks if stage_of(r, degrees) == rb.stage):
                    if me == src:
                        segments = [ShardSegment.from_dict(d) for d in tables[dst]["segments"]]
                        where = positions(segments, *tables[dst]["tp"])
                        ctx.comm.send(pack_pieces(select(_renamed(mine, rename), where)), dst)
                    elif me == dst:
                        got.setdefault(source, []).extend(unpack_pieces(ctx.comm.recv(src)))
    return got


def _install(shard: ShardAccess, rb: StageRebuild, got: dict[int, list[Piece]], tp_rank: int, tp: int,
             scaler: Optional[dict], lr_scale: float) -> None:
    """This lost rank's shard: the mix of its sources (or its launch's initialisation), fresh Adam state."""
    o = shard.optimizer
    size = o.master.numel()
    sources = [place(got.get(s, []), o.shard_segments, tp_rank, tp, size)["master"] for s, _ in rb.sources]
    master = mix(sources, [w for _, w in rb.sources]) if sources else o.master.detach().cpu().clone()
    zeros = torch.zeros_like(master)
    shard.load_state({"master": master, "exp_avg": zeros, "exp_avg_sq": zeros.clone()}, 0, scaler,
                     f"CheckFree's rebuild of stage {rb.stage}")
    o.lr_scale = lr_scale
    shard.set_grad_sumsq(None)


def rebuild(ctx: CheckpointContext, shard: ShardAccess, consensus: Consensus) -> dict:
    """Rebuild the consensus's lost stages on their ranks (module docstring); collective, after every other rank
    restored to E and before the parameters are published. Returns the recovery record's ``checkfree`` part."""
    cf, degrees, end = ctx.cfg.checkfree, ctx.layout.degrees, consensus.end
    o = shard.optimizer
    lost = ctx.layout.pp_rank in consensus.lost_stages
    tables = ctx.comm.gather({"layers": layers_of([s.name for s in o.shard_segments]),
                              "sumsq": None if lost else shard.grad_sumsq,
                              "segments": [s.to_dict() for s in o.shard_segments],
                              "tp": (ctx.layout.tp_rank, ctx.layout.tp),
                              "scaler": None if lost or o.scaler is None else o.scaler.state_dict()},
                             what="CheckFree (stage descriptions)")
    stage_layers: list[set[int]] = [set() for _ in range(degrees[1])]
    for rank, t in enumerate(tables):
        stage_layers[stage_of(rank, degrees)].update(t["layers"])
    sumsq = stage_sumsq([t["sumsq"] for t in tables], degrees)
    rebuilds = plan(consensus.lost_stages, [sorted(s) for s in stage_layers], sumsq, end, cf.init)
    fatal = None
    try:
        got = _exchange(ctx, shard, rebuilds, tables)
        if lost:
            rb = next(r for r in rebuilds if r.stage == ctx.layout.pp_rank)
            scaler = next((t["scaler"] for t in tables if t["scaler"] is not None), None)
            _install(shard, rb, got, ctx.layout.tp_rank, ctx.layout.tp, scaler, cf.lr_scale)
    except Exception as e:  # a transfer, a shard the pieces do not cover: fatal on every rank
        fatal = f"{type(e).__name__}: {e}"
    raise_fatal(ctx.comm.gather({"fatal": fatal}, what="the end of CheckFree"), "CheckFree's rebuild")
    shard.inexact_since = end
    record = {"stages": list(consensus.lost_stages), "init": cf.init, "lr_scale": cf.lr_scale, "exact": False,
              "at_step": end, "rebuilds": [rb.describe() for rb in rebuilds]}
    if ctx.rank == 0:
        log.warning("CheckFree rebuilt pipeline stage(s) %s at step %d (%s): %s; the state is NOT exact from here "
                    "on", record["stages"], end, cf.init, record["rebuilds"])
    return record
