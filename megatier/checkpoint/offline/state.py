"""A job's state at a recovery point, rebuilt offline from its tiers as a full, layout-free canonical state.

1. The point (:func:`choose_point`): by default the one a restore chooses
   (:func:`~megatier.checkpoint.recover.consensus.decide`: the furthest step E
   every rank of some layout reaches, from the newest base V on a tie between
   layouts); with a step N, the newest base V of any layout from which every
   rank of that layout reaches N (:func:`reachable_points` says which steps
   those are, for the error when N is none of them). A layout is the degrees
   and ``parallel.virtual_stages`` (from each copy's config record): at the
   same degrees, runs with other model chunks gave each rank other layers, so
   their copies never make one point.
2. The configuration (:func:`run_configs`): the config fingerprint the units
   reaching E are stamped with, as the tiers record it (key -> JSON value of
   every model and optimizer setting), gives the ModelConfig and the
   OptimConfig. It travels with the units in every tier and names exactly the
   run that wrote them, so no config file or run directory is needed.
3. The rebuild (:func:`rebuild`): each old rank's base V and its units up to E,
   read with fallback across copies (:class:`~megatier.checkpoint.offline.tiers.OfflineTiers`),
   replayed on a stand-alone shard with the same fused kernel as a restore
   (:class:`~megatier.checkpoint.recover.reshard.OldShard`), cut into canonical
   pieces and assembled (:func:`~megatier.optim.canonical.assemble`). So the
   state is the one a restore to (V, E) installs, under any layout: exact with
   lossless (fp32) diffs, a lossy codec's replay otherwise.

One old rank is held in memory at a time, besides the pieces gathered so far.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Iterable, Optional

from megatier.checkpoint.format.chain import reachable, replay_ends
from megatier.checkpoint.format.units import BASE
from megatier.checkpoint.offline.tiers import UNREADABLE, ExportError, Holdings, OfflineTiers, where
from megatier.checkpoint.recover.consensus import (
    ConfigCheck,
    Consensus,
    by_chunks,
    by_layout,
    consensus_at,
    decide,
    held_per_rank,
)
from megatier.checkpoint.recover.inventory import RecoveryError
from megatier.checkpoint.recover.reshard import OldShard
from megatier.checkpoint.shard import ShardAccess
from megatier.checkpoint.tiers.base import Copy
from megatier.config import ModelConfig, OptimConfig
from megatier.optim.canonical import STATE_KINDS, ReshardError, ShardState, assemble, shard_pieces
from megatier.parallel.layout import layout_str

Degrees = tuple[int, int, int]
PointLayout = tuple[Degrees, int]  # degrees and parallel.virtual_stages: what every rank of a point held
NO_LAYOUT: Degrees = (0, 0, 0)  # matches no layout: decide() then prefers the newest base among equal ends


def step_ranges(steps: Iterable[int], sep: str = ", ") -> str:
    """``0-8, 12, 14-16``: distinct integers (steps, ranks, nodes) as sorted runs."""
    runs: list[list[int]] = []
    for s in sorted(set(steps)):
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return sep.join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def point_layouts(copies: Iterable[Copy], job_id: str, fingerprints: dict[str, dict]
                  ) -> dict[PointLayout, list[Copy]]:
    """The job's copies by (degrees, parallel.virtual_stages) that wrote them (``fingerprints``: id -> record)."""
    config = ConfigCheck("", known=fingerprints)
    return {(degrees, v): part for degrees, usable in by_layout(copies, job_id)[0].items()
            for v, part in by_chunks(usable, config).items()}


def _layout_str(layout: PointLayout) -> str:
    degrees, v = layout
    return layout_str(degrees) + (f" with parallel.virtual_stages={v}" if v > 1 else "")


def reachable_points(copies: Iterable[Copy], job_id: str, fingerprints: dict[str, dict]
                     ) -> dict[PointLayout, dict[int, set[int]]]:
    """Layout -> {base V that every rank of it holds: the steps every rank reaches from V}."""
    out: dict[PointLayout, dict[int, set[int]]] = {}
    for layout, usable in point_layouts(copies, job_id, fingerprints).items():
        bases, diffs = held_per_rank(usable, math.prod(layout[0]))
        out[layout] = {v: set.intersection(*(set(reachable(v, d)) for d in diffs))
                       for v in set.intersection(*bases)}
    return out


def _no_point(holdings: Holdings, job_id: str) -> ExportError:
    if not holdings.traces:
        return ExportError(f"no checkpoints of job {job_id!r} in {' or '.join(holdings.looked) or 'any tier'}; "
                           f"check --job-id, --local-root, --remote-url and --tier")
    found = []
    for layout, usable in sorted(point_layouts(holdings.copies, job_id, holdings.fingerprints).items()):
        bases, _ = held_per_rank(usable, math.prod(layout[0]))
        found.append(f"{_layout_str(layout)}: bases per rank {[sorted(b) for b in bases]}")
    return ExportError(f"job {job_id!r} has no recovery point: no layout has a base that every one of its ranks "
                       f"holds ({'; '.join(found) or 'no complete unit'}) in {' or '.join(holdings.looked)}")


def _unreachable(holdings: Holdings, job_id: str, step: int, points: dict[PointLayout, dict[int, set[int]]]
                 ) -> ExportError:
    reach = [f"{step_ranges(s for steps in bases.values() for s in steps)} ({_layout_str(layout)})"
             for layout, bases in sorted(points.items()) if bases]
    pending = [str(p) for p in holdings.uncommitted if p.first <= step <= p.last]
    note = (f"; Tier-3 holds {', '.join(sorted(pending))} uncommitted, and uncommitted units are never read"
            if pending else "")
    return ExportError(f"step {step} is not a recovery point of job {job_id!r}: every rank of a layout reaches "
                       f"steps {'; '.join(reach)}{note}; pick one of those with --step")


def choose_point(holdings: Holdings, job_id: str, step: Optional[int]) -> Consensus:
    """The recovery point to export (module docstring, step 1); ExportError (exit status 1) when there is none."""
    points = reachable_points(holdings.copies, job_id, holdings.fingerprints)
    if not any(points.values()):
        raise _no_point(holdings, job_id)
    if step is None:
        try:  # the fingerprints let decide() split each layout's copies by their model chunks
            return decide(holdings.copies, job_id=job_id, degrees=NO_LAYOUT, traces=True, allow_fresh_start=False,
                          looked=" and ".join(holdings.looked), config=ConfigCheck("", known=holdings.fingerprints))
        except RecoveryError as e:
            raise ExportError(str(e)) from None
    candidates = [(v, layout) for layout, bases in points.items() for v, steps in bases.items() if step in steps]
    if not candidates:
        raise _unreachable(holdings, job_id, step, points)
    version, layout = max(candidates)  # the newest base: the shortest replay
    usable = point_layouts(holdings.copies, job_id, holdings.fingerprints)[layout]
    return consensus_at(usable, layout[0], version, step)


def _section(cls, prefix: str, fingerprint: dict, fp_id: str):
    values: dict = {}
    for key, value in fingerprint.items():
        if key.startswith(prefix + "."):  # a nested group's keys (model.moe.top_k) as a mapping of its own
            group, _, name = key[len(prefix) + 1:].rpartition(".")
            (values.setdefault(group, {}) if group else values)[name] = json.loads(value)
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ExportError(f"config fingerprint {fp_id} names {prefix} settings this MegaTier does not have "
                          f"({', '.join(unknown)}); export with the MegaTier version that trained the job")
    return cls(**values)


def point_fingerprint(holdings: Holdings, consensus: Consensus) -> tuple[str, dict]:
    """(id, fingerprint) of the config that wrote the units reaching E (rank 0's last unit of the chain)."""
    last = consensus.chains[0][-1]
    fp_id = consensus.copies[(0, last)][0].stamp.fingerprint
    if fp_id not in holdings.fingerprints:
        what = f"config fingerprint {fp_id}" if fp_id else "no config fingerprint (an older MegaTier wrote them)"
        raise ExportError(f"rank 0's {last} carries {what}, which no tier read records, so the model shape is "
                          f"unknown; export from the tiers that hold the job's fingerprints (drop --tier)")
    return fp_id, holdings.fingerprints[fp_id]


def run_configs(fingerprint: dict, fp_id: str = "") -> tuple[ModelConfig, OptimConfig]:
    """The ModelConfig and OptimConfig a config fingerprint records (``model.*`` and ``optim.*`` keys)."""
    return _section(ModelConfig, "model", fingerprint, fp_id), _section(OptimConfig, "optim", fingerprint, fp_id)


@dataclass
class _ReplayOptimizer:
    """What :class:`OldShard` takes from an optimizer: AdamW's settings, and no loss scaler (fp16 steps that were
    skipped replay from their flag alone; the scaler's own state is not exported)."""

    cfg: OptimConfig
    scaler: None = None


@dataclass
class Rebuilt:
    """The canonical state at the point and what it took to get there."""

    canonical: dict[str, dict[str, object]]  # name -> kind -> full unpadded fp32 tensor
    units: int = 0
    bytes_by_tier: dict[str, int] = field(default_factory=dict)
    fallbacks: list[str] = field(default_factory=list)
    codecs: set[str] = field(default_factory=set)  # diff codecs replayed ("fp32" alone: exact)
    adam_steps: int = 0  # Adam's bias-correction count at the point (the step less skipped fp16 steps)


def _rebuild_rank(tiers: OfflineTiers, c: Consensus, owner: int, optim: OptimConfig, out: Rebuilt) -> ShardState:
    """Old rank ``owner``'s shard at E: its base V, then each unit replayed up to where the chain leaves it."""
    access, layout = None, None
    for pid, upto in zip(c.chains[owner], replay_ends(c.chains[owner], c.end)):
        read = tiers.load(owner, pid, c.copies[(owner, pid)])
        out.units += 1
        out.bytes_by_tier[read.copy.tier] = out.bytes_by_tier.get(read.copy.tier, 0) + read.copy.stamp.size
        out.fallbacks += [f"rank {owner} {pid}: {why}; read {where(read.copy)} instead"
                          for why in read.failed]
        if pid.kind == BASE:
            access, layout = ShardAccess(OldShard(read.obj, _ReplayOptimizer(optim)), 1), read.copy.stamp.layout
            continue
        steps = [s for s in read.obj if s.step <= upto]
        out.codecs.update(s.header.get("mode", "?") for s in steps if not s.skipped)
        try:
            access.replay(steps)
        except (ValueError, RuntimeError) as e:  # a record that does not fit the shard it follows
            raise ExportError(f"replaying rank {owner}'s {pid} ({where(read.copy)}) failed: {e}",
                              UNREADABLE) from None
    o = access.optimizer
    out.adam_steps = o.adam_steps
    return ShardState(layout.tp_rank, layout.tp, o.shard_segments, {k: getattr(o, k) for k in STATE_KINDS})


def rebuild(tiers: OfflineTiers, consensus: Consensus, optim: OptimConfig) -> Rebuilt:
    """The canonical state at ``consensus`` (module docstring, step 3); ExportError (exit status 2) when a unit
    has no good copy or the shards do not make one model."""
    out = Rebuilt({})
    pieces = []
    try:
        for owner in range(math.prod(consensus.degrees)):
            pieces += shard_pieces(_rebuild_rank(tiers, consensus, owner, optim, out))
        out.canonical = assemble(pieces)
    except ReshardError as e:
        raise ExportError(f"cannot rebuild the state of {layout_str(consensus.degrees)}: {e}", UNREADABLE) from None
    return out

