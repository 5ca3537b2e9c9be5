"""``restore()``'s decision from the node leaders' summaries: rank 0 works in O(nodes), not O(world).

Each node's server (its lowest global rank, the node's *leader*) lists its
node's memory, as for the whole inventory. But rank 0 does not receive every
rank's share of those listings: each leader sends it a summary
(:func:`.summary.summarize`: a few holdings whatever the node's size). Of
Tier-3, rank 0 reads the committed units' record headers only
(:func:`~megatier.checkpoint.tiers.remote.committed_headers`: a line per 256
ranks, not every rank's stamp) and holds them as one holding per writer.
Rank 0 runs the restart-loop guard and the config check on the summaries'
facts, agrees on V, E and every owner span's chain (:func:`.summary.agree`),
and scatters each leader its part of that point with the facts every plan
carries. The leaders then exchange the node-memory copies of the agreed
units, each to the leader of the node whose rank fetches them
(:mod:`.routing`), read their own ranks' Tier-3 copies from the record parts
that hold them, cut their ranks' plans, and hand each rank its own. A rank so gets the plan rank 0
would have cut from the whole inventory, copy for copy
(tests/unit/checkpoint/recover/test_summary.py checks them equal).

What :func:`.summary.agree` leaves to the full consensus (a layout other than
the launch's, several layouts or configs, copies of another job, a lost stage,
a restore loop, followed config keys) makes rank 0 answer :data:`WHOLE`, and
every rank takes the whole inventory to rank 0 as before (:mod:`.plan`). So
does the consensus taken again without copies found bad.

docs/benchmarks.md ("The decision from per-node summaries") measures these
functions at 1k-100k ranks.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from megatier.checkpoint.commit.commit_record import RecordHeader
from megatier.checkpoint.context import CheckpointContext
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.recover.consensus import ConfigCheck, fresh_without
from megatier.checkpoint.recover.inventory import raise_fatal
from megatier.checkpoint.recover.loops import newest, plan, with_failure
from megatier.checkpoint.recover.plan import RankPlan, coordinated, reached
from megatier.checkpoint.recover.routing import plans_for, route, senders
from megatier.checkpoint.recover.summary import (
    Holding,
    Point,
    Summary,
    agree,
    interned,
    part,
    ranges,
    summarize,
)
from megatier.checkpoint.tiers.base import JOB, TIER1, TIER2, TIER3, Copy, Listing, Tier
from megatier.faults import CrashPoint

WHOLE = "the whole inventory"  # rank 0's answer when the full consensus must decide
FROM_LEADER = "from the node's leader"  # a rank that is no leader receives its plan from its node's


@dataclass
class LeaderPart:
    """What rank 0 sends a leader: the spans it routes copies of or cuts plans for, and every plan's facts."""

    point: Point
    shared: RankPlan


def listed_here(ctx: CheckpointContext, servers: dict[str, int]) -> list[Tier]:
    """The tiers this rank lists (and cleans, and keeps the restore history on): Tier-3 on rank 0, node memory
    on its node's server."""
    return [t for t in ctx.tiers if (0 if t.scope == JOB else servers[ctx.node]) == ctx.rank]


def _list(ctx: CheckpointContext, servers: dict[str, int]) -> tuple[dict[str, Listing], Optional[str]]:
    """The listings of the tiers this rank lists (Tier-3's: its record headers, :meth:`Tier.decision_listing`),
    and why listing failed (None if it did not)."""
    listings: dict[str, Listing] = {}
    try:
        for tier in listed_here(ctx, servers):
            tier.settle()
            listings[tier.label] = tier.decision_listing()
    except Exception as e:  # an unreadable area or an unreachable Tier-3 must stop every rank, not only this one
        return listings, f"inventory on {ctx.node} failed: {type(e).__name__}: {e}"
    return listings, None


def header_holdings(headers: Sequence[RecordHeader]) -> list[Holding]:
    """Tier-3's committed units as holdings, from their record headers: one per writer (job, config, layout),
    every rank of its world an owner."""
    kinds: dict[tuple, list[PayloadId]] = {}
    for h in headers:
        kinds.setdefault((h.job_id, h.fingerprint, h.degrees, h.world_size), []).append(h.pid)
    return [Holding(TIER3, None, job, fingerprint, degrees, tuple(sorted(pids)), ((0, world),))
            for (job, fingerprint, degrees, world), pids in kinds.items()]


class NodeDecider:
    """Rank 0's side: the summaries of every lister, and the decision cut into one item per rank."""

    def __init__(self, ctx: CheckpointContext, rank_nodes: Sequence[str], servers: dict[str, int], items: list):
        self.ctx, self.rank_nodes, self.servers, self.items = ctx, list(rank_nodes), servers, items

    def decide(self, allow_fresh_start: bool) -> list:
        raise_fatal(self.items, "the inventory")
        ctx, world = self.ctx, len(self.rank_nodes)
        table: dict = {}
        summaries: dict[int, Summary] = {r: it["summary"] for r, it in enumerate(self.items) if it["summary"]}
        facts = [f for s in summaries.values() for f in s.facts.values()]
        holdings = {r: interned(s.holdings, table) for r, s in summaries.items()}
        held = [h for hs in holdings.values() for h in hs]
        last = max((s for f in facts for s in f.progress.values()), default=None)
        newest_unit = max((p.last for h in held for p in h.pids), default=None)
        history = with_failure(newest([f.restores for f in facts if f.restores]),
                               reached(last, any(h.tier == TIER1 for h in held), newest_unit))
        rule = ctx.reliability
        fallback = plan(history, rule.loop_window, rule.loop_limit)
        shared = RankPlan(None, history=history, fallback=fallback, notes=[n for f in facts for n in f.notes],
                          last_step=last, tier1_present=any(h.tier in (TIER1, TIER2) for h in held),
                          decided_by="nodes")
        unknown = [f.unknown for f in facts if f.unknown]
        if not fallback.level and fresh_without(unknown, any(f.traces for f in facts if not f.unknown),
                                                ctx.job_id, allow_fresh_start):
            return [shared] * world
        fingerprints = {i: fp for f in facts for i, fp in f.fingerprints.items()}
        config = ConfigCheck(ctx.fingerprint_id, ctx.fingerprint, fingerprints, tuple(ctx.cfg.allow_changes),
                             ctx.followed)
        point = None if fallback.level or config.follow else agree(held, job_id=ctx.job_id, config=config)
        if point is None or point.degrees != ctx.layout.degrees:
            return [WHOLE] * world
        items: list = [FROM_LEADER] * world
        for node, leader in self.servers.items():
            own = ranges(r for r, n in enumerate(self.rank_nodes) if n == node)
            routed = [rng for h in holdings.get(leader, []) if h.node is not None for rng in h.owners]
            items[leader] = LeaderPart(part(point, [*own, *routed]), shared)
        return items


def _route(ctx: CheckpointContext, rank_nodes: Sequence[str], servers: dict[str, int], point: Point,
           copies: list[Copy]) -> list[Copy]:
    """Collective among the leaders: send every leader the node-memory copies of the agreed units its ranks
    fetch, receive those of this node's ranks from their holders. Every message is sent, empty or not, so each
    leader knows from the point alone whom it hears from. Tier-3's copies are read, not routed
    (:func:`_tier3_copies`)."""
    by_node = route(point, copies, rank_nodes)
    mine = {(c.tier, c.node) for c in copies}
    dests: set[int] = set()
    for span in point.spans:
        if mine.intersection(span.holders):
            dests.update(servers[rank_nodes[o]] for o in range(span.lo, span.hi))
    ranks = [r for r, n in enumerate(rank_nodes) if n == ctx.node]
    sources = {servers[node] for _, node in senders(point, ranks) if node is not None}
    outgoing = {d: pickle.dumps(by_node.get(rank_nodes[d], [])) for d in dests if d != ctx.rank}
    got = ctx.comm.exchange(outgoing, sorted(sources - {ctx.rank}))
    received = [c for blob in got.values() for c in pickle.loads(blob)]
    return received + (by_node.get(ctx.node, []) if ctx.rank in sources else [])


def _tier3_copies(ctx: CheckpointContext, point: Point, ranks: list[int]) -> tuple[list[Copy], list[str]]:
    """This leader's ranks' Tier-3 copies of the agreed units, read from the record parts that hold them (a
    unit the point names that Tier-3 has not committed is skipped), and notes on what could not be read."""
    remote = next((t for t in ctx.tiers if t.scope == JOB), None)
    spans = [s for lo, hi in ranges(ranks) for s in point.spans_of(lo, hi) if (remote.label, None) in s.holders] \
        if remote is not None else []
    if remote is None or not spans:
        return [], []
    pids = sorted({p for s in spans for p in s.chain}, key=lambda p: (p.last, p.kind))
    return remote.copies_of(pids, list(ranges(ranks)))


def decide_by_nodes(ctx: CheckpointContext, rank_nodes: Sequence[str], servers: dict[str, int],
                    allow_fresh_start: bool, live: int) -> tuple[Optional[RankPlan], list[PayloadId]]:
    """Collective: this rank's plan decided from the leaders' summaries, or None on every rank when the whole
    inventory must decide; and the units committed on Tier-3 this rank read (rank 0's; none elsewhere).
    ``live``: the step this rank's state is at (the crash point between inventory and consensus names it)."""
    listings, fatal = _list(ctx, servers)
    headers = [h for listing in listings.values() for h in listing.headers]
    summary = None
    if listings:
        summary = summarize(listings)
        summary.holdings += header_holdings(headers)
    items = ctx.comm.collect({"summary": summary, "fatal": fatal}, what="the recovery inventory (node summaries)")
    ctx.fault(CrashPoint.RECOVER_CONSENSUS, live)
    decider = NodeDecider(ctx, rank_nodes, servers, items) if items is not None else None
    got = coordinated(ctx.comm, (lambda: decider.decide(allow_fresh_start)) if decider else None,
                      "the recovery plan (from node summaries)")
    committed = sorted({h.pid for h in headers} | {c.pid for c in listings.get(TIER3, Listing()).copies},
                       key=lambda p: (p.last, p.kind))
    if got == WHOLE:
        return None, committed
    if isinstance(got, RankPlan):  # a fresh start: no plan to cut
        return got, committed
    leader = servers[ctx.node]
    if isinstance(got, LeaderPart):
        copies = [c for listing in listings.values() for c in listing.copies if c.node is not None]
        ranks = [r for r, n in enumerate(rank_nodes) if n == ctx.node]
        received = _route(ctx, rank_nodes, servers, got.point, copies)
        remote, notes = _tier3_copies(ctx, got.point, ranks)
        shared = replace(got.shared, notes=got.shared.notes + notes) if notes else got.shared
        plans = dict(zip(ranks, plans_for(got.point, ranks, received + remote, shared)))
        ctx.comm.exchange({r: pickle.dumps(p) for r, p in plans.items() if r != ctx.rank}, [])
        return plans[ctx.rank], committed
    return pickle.loads(ctx.comm.exchange({}, [leader])[leader]), committed
