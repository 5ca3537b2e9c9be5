"""CheckFree (arXiv:2506.15461, section 4.2): a pipeline stage lost from every tier, rebuilt from its two neighbours.

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

Model chunks (``parallel.virtual_stages`` v > 1, :mod:`megatier.parallel.interleaved`):
chunk c of stage i runs virtual stage c * P + i, whose neighbours in the virtual
pipeline are chunk c of stages i-1 and i+1 (0 < i < P-1). Parameters keep their
global layer names and every chunk holds L = num_layers / (P v) layers (the
config's checks), so in sorted order a stage's k-th layer is layer k mod L of its
chunk k // L on every stage: the rename of step 3 maps each chunk onto the
neighbour's same chunk, layer by layer (``(c P + j) L + m -> (c P + i) L + m``),
with v = 1 the one-chunk case. The weights stay whole stages' squared gradient
norms, one per stage for all its chunks (per-chunk norms are not recorded).
Only the first chunk of stage 0 embeds and only the last chunk of stage P-1 holds
the head, but those stages stay ends: refused as below (CheckFree+ does not run
with model chunks).

The first and last stage hold the embedding and the output head, so CheckFree
alone cannot rebuild them. A job trained with ``model.pipeline_order=checkfree_plus``
(arXiv:2506.15461, section 4.3, :mod:`megatier.parallel.checkfree_plus`) can: the lost
end stage's layers become a copy of its *stand-in* (stage 1 for stage 0, P-2
for P-1: the swap partner that learned to do its job), and every parameter of a
lost stage that is not a transformer layer (the word embedding, positions, final
norm, an untied head, and the replicas a stage keeps) is copied bit for bit from
the nearest surviving stage that holds it or a copy of it (GPT-2's tied head and
the replicas), :func:`plan`.

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
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from megatier.checkpoint.context import CheckpointContext
from megatier.checkpoint.recover.consensus import Consensus, stage_of
from megatier.checkpoint.recover.inventory import RecoveryError, raise_fatal
from megatier.checkpoint.recover.reshard import pack_pieces, unpack_pieces
from megatier.checkpoint.shard import ShardAccess
from megatier.model.params import canonical_name
from megatier.optim.canonical import Piece, ShardState, place, positions, select, shard_pieces
from megatier.optim.flat import ShardSegment
from megatier.parallel.checkfree_plus import has_stand_ins, stand_in

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def layers_of(names: Sequence[str]) -> list[int]:
    """The global indices of the transformer layers among parameter names (``layers.<i>.<rest>``)."""
    return sorted({int(m.group(1)) for n in names if (m := _LAYER.match(n))})


@dataclass(frozen=True)
class StageRebuild:
    """How one lost stage is rebuilt: its layers from ``sources`` (stage, weight), each source's layers renamed
    to the lost stage's by ``renames[k]`` (global layer index there -> here), mixed (:func:`mix`); its other
    parameters copied exactly from ``extras`` (canonical name -> the surviving stage that holds it)."""

    stage: int
    sources: tuple[tuple[int, float], ...]
    renames: tuple[dict[int, int], ...]
    extras: dict[str, int] = field(default_factory=dict)
    stand_in: bool = False  # CheckFree+: the layers are a copy of the lost end stage's swap partner

    def describe(self) -> dict:
        return {"stage": self.stage, "neighbours": [s for s, _ in self.sources],
                "weights": [w for _, w in self.sources], "stand_in": self.stand_in,
                "exact_copies": {name: stage for name, stage in sorted(self.extras.items())}}

    def senders(self) -> list[int]:
        """Every stage that sends this rebuild something, in order."""
        return sorted({s for s, _ in self.sources} | set(self.extras.values()))


def stage_sumsq(parts: Sequence[Optional[float]], degrees: tuple[int, int, int]) -> list[Optional[float]]:
    """Each stage's squared gradient norm from its ranks' parts (None when some rank's part is unknown)."""
    total: list[Optional[float]] = [0.0] * degrees[1]
    for rank, part in enumerate(parts):
        s = stage_of(rank, degrees)
        total[s] = None if part is None or total[s] is None else total[s] + part
    return total


def _refuse(i: int, why: str) -> RecoveryError:
    return RecoveryError(f"refusing CheckFree for stage {i}: {why}")


def _layer_sources(i: int, pp: int, stage_names: Sequence[set[str]], sumsq: Sequence[Optional[float]], end: int,
                   init: str) -> tuple[tuple[tuple[int, float], ...], bool]:
    """Where stage ``i``'s layers come from: ((stage, weight), ...) and whether it is a CheckFree+ stand-in."""
    if i in (0, pp - 1):
        if pp < 4 or not has_stand_ins(stage_names):
            raise _refuse(i, "it holds the embedding or the output head, and CheckFree rebuilds only intermediate "
                             "stages; a job trained with model.pipeline_order=checkfree_plus (pp >= 4) can rebuild "
                             "it from its stand-in. Restore its units (e.g. a Tier-3 copy) and relaunch")
        return ((stand_in(i, pp), 1.0),), True
    sides = {"weighted": (i - 1, i + 1), "copy": (i - 1,), "random": ()}[init]
    for j in sides:
        if sumsq[j] is None:
            raise _refuse(i, f"the last gradient norm of its neighbour stage {j} is not recorded at step {end} "
                             f"(units written before MegaTier recorded it); restore stage {i}'s units instead")
    return tuple((j, sumsq[j] if init == "weighted" else 1.0) for j in sides), False


def _extras(i: int, lost: Sequence[int], stage_names: Sequence[set[str]], canonical: Callable[[str], str]
            ) -> dict[str, int]:
    """Each of stage ``i``'s parameters other than layers -> the nearest surviving stage holding it (or a copy)."""
    held = [{canonical(n) for n in names} for names in stage_names]
    out = {}
    for name in sorted(held[i]):
        if _LAYER.match(name):
            continue
        holders = sorted((abs(j - i), j) for j, names in enumerate(held) if name in names and j not in lost)
        if not holders:
            raise _refuse(i, f"no surviving stage holds {name} or a copy of it (the first and the last stage "
                             f"share the word embedding: both are lost)")
        out[name] = holders[0][1]
    return out


def plan(lost: Sequence[int], stage_names: Sequence[set[str]], sumsq: Sequence[Optional[float]], end: int,
         init: str, canonical: Callable[[str], str] = canonical_name) -> list[StageRebuild]:
    """The rebuild of every lost stage (pure; every rank computes the same); RecoveryError naming the stage when
    it cannot be done. ``stage_names[j]``: the parameter names stage j holds; ``sumsq[j]``: its squared
    gradient norm at ``end``; ``init``: weighted (both neighbours), copy (the previous one), random (none);
    ``canonical(name)``: the parameter whose values ``name`` holds (a copy's source; GPT-2's by default)."""
    pp, out = len(stage_names), []
    for i in lost:
        sources, stand = _layer_sources(i, pp, stage_names, sumsq, end, init)
        mine = layers_of(stage_names[i])
        for j in {*(s for s, _ in sources), *((i - 1, i + 1) if 0 < i < pp - 1 else ())}:
            if len(layers_of(stage_names[j])) != len(mine):
                raise _refuse(i, f"it holds {len(mine)} transformer layers and stage {j} "
                                 f"{len(layers_of(stage_names[j]))}; CheckFree needs stages of identical shape "
                                 f"(model.num_layers divisible by parallel.pp x parallel.virtual_stages)")
        # Sorted position for sorted position: chunk by chunk with model chunks (module docstring).
        renames = tuple(dict(zip(layers_of(stage_names[j]), mine)) for j, _ in sources)
        out.append(StageRebuild(i, sources, renames, _extras(i, lost, stage_names, canonical), stand))
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


def _pieces_for(rb: StageRebuild, source: int, layers: list[Piece], everything: list[Piece]) -> list[Piece]:
    """What stage ``source`` sends for ``rb``: its layers renamed (if a layer source), the extras it holds."""
    out = []
    for (stage, _), rename in zip(rb.sources, rb.renames):
        if stage == source:
            out += _renamed(layers, rename)
    return out + [p for p in everything if rb.extras.get(p.name) == source]


def _exchange(ctx: CheckpointContext, shard: ShardAccess, rebuilds: list[StageRebuild], tables: list[dict]
              ) -> dict[int, list[Piece]]:
    """Send every lost rank its elements from each sending stage, in one global order; returns what this rank
    got, by sending stage (empty on other ranks)."""
    o, me, degrees = shard.optimizer, ctx.rank, ctx.layout.degrees
    ranks = range(ctx.comm.world_size)
    state = ShardState(ctx.layout.tp_rank, ctx.layout.tp, o.shard_segments,
                       {k: getattr(o, k) for k in ("master", "exp_avg", "exp_avg_sq")})
    mine: Optional[tuple[list[Piece], list[Piece]]] = None  # (primary pieces, with copies), cut once
    got: dict[int, list[Piece]] = {}
    for rb in rebuilds:
        for source in rb.senders():
            for src in (r for r in ranks if stage_of(r, degrees) == source):
                if src == me and mine is None:
                    mine = shard_pieces(state), shard_pieces(state, with_copies=True)
                for dst in (r for r in ranks if stage_of(r, degrees) == rb.stage):
                    if me == src:
                        segments = [ShardSegment.from_dict(d) for d in tables[dst]["segments"]]
                        where = positions(segments, *tables[dst]["tp"])
                        ctx.comm.send(pack_pieces(select(_pieces_for(rb, source, *mine), where)), dst)
                    elif me == dst:
                        got.setdefault(source, []).extend(unpack_pieces(ctx.comm.recv(src)))
    return got


def _install(shard: ShardAccess, rb: StageRebuild, got: dict[int, list[Piece]], tp_rank: int, tp: int,
             scaler: Optional[dict], lr_scale: float) -> None:
    """This lost rank's shard: its layers mixed from their sources (or its launch's initialisation), its other
    parameters exact copies; fresh Adam state."""
    o = shard.optimizer
    size, segments = o.master.numel(), o.shard_segments
    extras = [p for pieces in got.values() for p in pieces if not _LAYER.match(p.name)]
    # Each source's layers with the extras (place() checks that together they cover the shard exactly once).
    layers = [place([p for p in got.get(s, []) if _LAYER.match(p.name)] + extras, segments, tp_rank, tp,
                    size)["master"] for s, _ in rb.sources]
    master = mix(layers, [w for _, w in rb.sources]) if layers else o.master.detach().cpu().clone()
    where = positions(segments, tp_rank, tp)
    for p in extras:  # bit for bit, whatever the mix did to them
        at = where[p.name][p.index]
        master[at[at >= 0]] = p.values["master"][at >= 0].float()
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
    tables = ctx.comm.gather({"sumsq": None if lost else shard.grad_sumsq,
                              "segments": [s.to_dict() for s in o.shard_segments],
                              "tp": (ctx.layout.tp_rank, ctx.layout.tp),
                              "scaler": None if lost or o.scaler is None else o.scaler.state_dict()},
                             what="CheckFree (stage descriptions)")
    stage_names: list[set[str]] = [set() for _ in range(degrees[1])]
    sources = {}  # the segments say which parameters are copies of which (the tied head, the replicas)
    for rank, t in enumerate(tables):
        stage_names[stage_of(rank, degrees)].update(d["name"] for d in t["segments"])
        sources.update((d["name"], d.get("source") or d["name"]) for d in t["segments"])
    sumsq = stage_sumsq([t["sumsq"] for t in tables], degrees)
    rebuilds = plan(consensus.lost_stages, stage_names, sumsq, end, cf.init, lambda n: sources.get(n, n))
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
