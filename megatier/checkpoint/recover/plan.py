"""Rank 0 decides the recovery for every rank; each rank receives only its own part.

The consensus is a pure function of the whole inventory, and every rank used
to derive it for itself, so every rank held every rank's listing: O(world)
memory and CPU per rank (0.6 GiB and a minute and a half at 98k ranks,
docs/benchmarks.md) where a rank needs only the copies of its own units. Now
rank 0 alone holds the merged inventory (:class:`Coordinator`), runs the
restart-loop guard and the consensus, and cuts the decision into one
:class:`RankPlan` per rank: the point (V, E, the layout that wrote it), the
chains and candidate copies of the old ranks this rank fetches (its own in
the same layout), the pass and round counts every rank runs in step, and the
facts the record and the tiers' restore history need. A scatter hands each
rank its plan, so a rank other than 0 receives and holds O(its units).

The cascade needs no more than that: a rank still missing a unit says which
copy it tries next, and which rank serves it, in the round's status gather
(:mod:`.cascade`). The same holds when the consensus is taken again without
the copies found bad: rank 0 decides again and scatters new plans.

A decision that fails on rank 0 (a refused configuration, a restore loop, no
common base) is scattered instead of the plans and raised as the same error
on every rank.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Optional, Sequence

from megatier.checkpoint.comm import CheckpointComm
from megatier.checkpoint.context import CheckpointContext
from megatier.checkpoint.format.units import BASE, PayloadId
from megatier.checkpoint.recover.consensus import ConfigCheck, Consensus, decide, fresh_without
from megatier.checkpoint.recover.inventory import Collected, Inventory, RecoveryError, last_step
from megatier.checkpoint.recover.loops import (
    Fallback,
    RestoreLoop,
    newest,
    plan,
    stop_line,
    trailing_loops,
    with_failure,
)
from megatier.checkpoint.recover.reshard import assign
from megatier.checkpoint.tiers.base import TIER1, TIER2, TIER3, Copy

log = logging.getLogger(__name__)


@dataclass
class RankPlan:
    """One rank's part of the recovery rank 0 decided."""

    consensus: Optional[Consensus]  # restricted to the old ranks this rank fetches; None: start fresh
    passes: list[Optional[int]] = field(default_factory=list)  # the old rank it fetches in each pass (None: none)
    rounds: list[int] = field(default_factory=list)  # each pass's rounds, the same on every rank
    history: list[dict] = field(default_factory=list)  # the job's restore history (:mod:`.loops`)
    fallback: Fallback = Fallback()
    notes: list[str] = field(default_factory=list)  # what the listers found wrong (torn writes, ...)
    adopted: dict = field(default_factory=dict)  # followed fingerprint keys -> the values recorded with V
    tier1_present: bool = False  # any node memory survived (the record's failure class)
    last_step: Optional[int] = None  # the newest step any rank reached (the record's steps lost)
    decided_by: str = "rank 0"  # "nodes": from the node leaders' summaries (:mod:`.by_node`)


@dataclass(frozen=True)
class Refusal:
    """A decision that failed on rank 0, sent instead of the plans and raised on every rank."""

    error: type
    message: str


def coordinated(comm: CheckpointComm, decide_all: Optional[Callable[[], list[RankPlan]]], what: str) -> RankPlan:
    """Collective: rank 0 runs ``decide_all`` (one plan per rank; the others pass None), each rank receives its
    own. An error there is raised on every rank: a RecoveryError as itself, anything else as a RecoveryError
    naming it."""
    items, raised = None, None
    if comm.rank == 0:
        try:
            items = decide_all()
        except Exception as e:  # every rank waits in the scatter: it must learn the decision failed
            raised = e
            kind = type(e) if isinstance(e, RecoveryError) else RecoveryError
            text = str(e) if isinstance(e, RecoveryError) else f"rank 0 failed deciding {what}: {type(e).__name__}: {e}"
            items = [Refusal(kind, text)] * comm.world_size
    got = comm.scatter(items, what=what)
    if raised is not None:
        raise raised
    if isinstance(got, Refusal):
        raise got.error(got.message)
    return got


def reached(last: Optional[int], tier1_held: bool, newest_unit: Optional[int]) -> Optional[int]:
    """The newest step the job reached before this restore: the progress keys' newest (``last``), or the newest
    unit anywhere (a launch that died before its first step left no progress key). None when no node memory
    survived (no progress, nothing held in Tier-1): a rack failure takes the progress keys with it, and Tier-3's
    units alone would make a launch that trained on look like one that failed at once (a loop)."""
    if last is None and not tier1_held:
        return None
    return max((s for s in (last, newest_unit) if s is not None), default=None)


def _reached(inv: Inventory) -> Optional[int]:
    return reached(last_step(inv), inv.has_copies(TIER1), max((c.pid.last for c in inv.copies), default=None))


def passes_of(consensus: Consensus, rank_nodes: Sequence[str], degrees: tuple[int, int, int]
              ) -> tuple[list[list[Optional[int]]], list[int]]:
    """Each rank's old rank per pass, and every pass's rounds. In the job's own layout one pass, each rank
    fetching its own chain (a lost stage's ranks none); resharding, the passes of :func:`.reshard.assign`."""
    world = len(rank_nodes)
    if not consensus.resharded(degrees):
        rounds = max((len(chain) for chain in consensus.chains.values()), default=0)
        return [[r if r in consensus.chains else None] for r in range(world)], [rounds]
    passes = assign(consensus, rank_nodes)
    rounds = [max(len(consensus.chains[old]) for old in p.values()) for p in passes]
    return [[p.get(r) for p in passes] for r in range(world)], rounds


def cut(consensus: Optional[Consensus], rank_nodes: Sequence[str], degrees: tuple[int, int, int],
        shared: RankPlan) -> list[RankPlan]:
    """One plan per rank of this job (on ``rank_nodes``, of layout ``degrees``): ``shared``'s facts, and the
    part of ``consensus`` and the passes that rank fetches."""
    if consensus is None:
        return [shared] * len(rank_nodes)
    owners, rounds = passes_of(consensus, rank_nodes, degrees)
    return [replace(shared, consensus=consensus.part(o for o in mine if o is not None), passes=mine, rounds=rounds)
            for mine in owners]


class Coordinator:
    """Rank 0's side of the recovery: the whole inventory, the decisions, and each rank's plan cut from them."""

    def __init__(self, ctx: CheckpointContext, collected: Collected):
        self.ctx = ctx
        self.collected = collected
        self.rank_nodes = collected.rank_nodes
        self.inv = Inventory(self.rank_nodes, {})
        self.history: list[dict] = []
        self.fallback = Fallback()

    def _config(self) -> ConfigCheck:
        ctx = self.ctx
        return ConfigCheck(ctx.fingerprint_id, ctx.fingerprint, self.inv.fingerprints, tuple(ctx.cfg.allow_changes),
                           ctx.followed)

    def _agree(self, bad: set, allow_fresh_start: bool) -> Optional[Consensus]:
        ctx, inv = self.ctx, self.inv
        return decide([c for c in self.fallback.usable(inv.copies) if c not in bad], job_id=ctx.job_id,
                      degrees=ctx.layout.degrees, traces=inv.traces,
                      allow_fresh_start=allow_fresh_start and not self.fallback.level, looked=inv.looked(),
                      config=self._config(), last_resort=ctx.cfg.last_resort)

    def merged(self) -> "Coordinator":
        """Merge the inventory and read the restore history: a rank whose listing failed fails every rank."""
        self.inv = self.collected.inventory(self.ctx.tiers)
        self.history = with_failure(newest(self.inv.histories), _reached(self.inv))
        rule = self.ctx.reliability
        self.fallback = plan(self.history, rule.loop_window, rule.loop_limit)
        return self

    def first(self, allow_fresh_start: bool) -> list[RankPlan]:
        """The plans of the point the restart-loop guard allows (:mod:`.loops`); RestoreLoop when none is left."""
        self.merged()
        rule = self.ctx.reliability
        if not self.fallback.level:
            if fresh_without(self.inv.unknown, self.inv.known_traces, self.ctx.job_id, allow_fresh_start):
                return self.plans(None)
            consensus = self._agree(set(), allow_fresh_start)
            if consensus is None:
                log.info("no checkpoint of job %r to recover; starting fresh (looked in %s)", self.ctx.job_id,
                         self.inv.looked())
            return self.plans(consensus)
        loops = trailing_loops(self.history, rule.loop_window)
        try:
            consensus = self._agree(set(), False)
        except RecoveryError as e:
            raise RestoreLoop(stop_line(loops, rule.loop_window, rule.loop_limit,
                                        f"{self.fallback.describe()} is not complete in any tier ({e})")) from None
        log.warning("restore loop: the job failed within reliability.loop_window=%d steps of its last %d restores "
                    "(at step %d each time); restoring %s: v%d on its own, the steps after it are trained again",
                    rule.loop_window, len(loops), loops[-1]["reached"], self.fallback.describe(), consensus.version)
        return self.plans(consensus)

    def again(self, bad: set[Copy], why: str, fallbacks: list[str]) -> list[RankPlan]:
        """The plans of the consensus taken again without the ``bad`` copies (never a fresh start: the shards are
        already partly overwritten). Merges the inventory first when the first decision came from the node
        summaries (:mod:`.by_node`)."""
        if not self.inv.listings:
            self.merged()
        log.warning("%s; taking the consensus again without the %d bad copies", why, len(bad))
        try:
            return self.plans(self._agree(bad, False))
        except RecoveryError as again:
            raise RecoveryError(f"{why}, and without the bad copies: {again}; bad copies: {fallbacks}") from None

    def plans(self, consensus: Optional[Consensus]) -> list[RankPlan]:
        inv = self.inv
        shared = RankPlan(None, history=self.history, fallback=self.fallback, notes=inv.notes,
                          last_step=last_step(inv), tier1_present=inv.has_copies(TIER1) or inv.has_copies(TIER2))
        if consensus is not None:
            shared.adopted = self._config().followed_values(consensus)
        return cut(consensus, self.rank_nodes, self.ctx.layout.degrees, shared)

    def durable(self, version: int, bad: set[Copy]) -> Optional[int]:
        return durable_base({c.pid for c in self.inv.copies if c.tier == TIER3}, version, bad)


def durable_base(units: Iterable[PayloadId], version: int, bad: set[Copy]) -> Optional[int]:
    """The newest base committed on Tier-3 (``units``: its committed units) at or before ``version`` of which
    no copy there was found bad."""
    spoiled = {c.pid for c in bad if c.tier == TIER3}
    return max((p.version for p in units if p.kind == BASE and p.version <= version and p not in spoiled),
               default=None)
