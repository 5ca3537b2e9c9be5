"""Recovery path: ``restore()`` before the training loop (TierCheck, arXiv:2605.17821, section 3.3).

Collective over every rank, in these phases:

1. Decision from the node leaders' summaries (:mod:`.by_node`): each node's
   leader lists its memory, rank 0 Tier-3; rank 0 agrees on V, E and every
   owner's chain from their summaries, and the leaders route the copies and
   cut their ranks' plans (:mod:`.plan`'s :class:`RankPlan`).
2. Where that is not the common case (another layout, job or config, a lost
   stage, a restore loop), or when the consensus is taken again without bad
   copies: the whole inventory (:mod:`.inventory`), gathered on rank 0, which
   decides the full consensus (:mod:`.consensus`) and sends each rank only
   its own part (:mod:`.plan`).
3. Cascade (:mod:`.cascade`): one round per position in the chains; each rank
   gets its unit from the cheapest tier that has a good copy.
4. Replay: ``load_base``, one fused ``replay`` per unit (a diff batch or a
   step unit, cut where the chain leaves it: :func:`..format.chain.replay_ends`;
   the ``replay.mid_batch`` crash point between units); a stage the consensus
   found lost is then rebuilt from its neighbours (``last_resort=checkfree``:
   :mod:`.checkfree`); then ``publish`` once.

When a rank runs out of copies of a unit, the consensus is taken again without
every copy found bad (an older base or a shorter chain may still be complete
everywhere), and the rounds start over from the new base; if none is left,
every rank raises RecoveryError.

Before the consensus, the restart-loop guard (:mod:`.loops`) reads the job's restore history from the
inventory on rank 0: a job that keeps failing right after its restores takes an older point, or stops (exit 6). The
restore's entry is added to the history on every tier after cleanup.

Then cleanup, so later saves never mix with stale units: whoever lists a tier
(each node's server for node memory, rank 0 for Tier-3) has it discard
leftovers of crashed writes and units beyond E (:meth:`Tier.discard_after`).
A last gather makes sure no rank resumes (and starts writing) before every
tier is clean, and carries the per-rank timings for the record.

Every failure inside a phase travels in the next status gather, so a problem
on one rank becomes the same RecoveryError on all ranks; every collective and
transfer waits at most the job timeout.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional

from megatier.checkpoint.context import CheckpointContext
from megatier.checkpoint.format.chain import replay_ends
from megatier.checkpoint.format.units import BASE, PayloadId
from megatier.checkpoint.recover.by_node import decide_by_nodes, listed_here
from megatier.checkpoint.recover.cascade import Exhausted, Fetcher, Reader
from megatier.checkpoint.recover.checkfree import rebuild
from megatier.checkpoint.recover.consensus import Consensus
from megatier.checkpoint.recover.inventory import node_names, node_servers, raise_fatal, take_inventory
from megatier.checkpoint.recover.loops import appended
from megatier.checkpoint.recover.plan import Coordinator, RankPlan, coordinated, durable_base
from megatier.checkpoint.recover.record import recovery_record
from megatier.checkpoint.recover.reshard import Rebuilder, describe, exchange, reshard_label
from megatier.checkpoint.shard import ShardAccess
from megatier.checkpoint.storage.store import StoreError
from megatier.faults import CrashPoint


@dataclass
class RecoveryResult:
    """The state is now version ``end`` (replayed from base ``version``); training resumes at end + 1."""

    version: int
    end: int
    record: dict
    adopted: dict = field(default_factory=dict)  # followed fingerprint keys -> the job's recorded values
    history: list[dict] = field(default_factory=list)  # the job's restore history, this restore's entry last
    keeps_history: list = field(default_factory=list)  # the tiers this rank keeps it on (those it lists)
    durable_base: Optional[int] = None  # the newest base committed on Tier-3 at or before the point restored


def _apply(ctx: CheckpointContext, target, pid: Optional[PayloadId], obj: Any, upto: int) -> Optional[str]:
    """Load the base into ``target`` (this rank's ShardAccess, or the Rebuilder of old shards), or replay one
    unit's records up to step ``upto``; an error is returned (and gathered), not raised."""
    if pid is None:
        return None
    try:
        if pid.kind == BASE:
            target.load_base(obj)
        else:
            target.replay([s for s in obj if s.step <= upto])
            ctx.fault(CrashPoint.REPLAY_MID_BATCH, upto)
    except Exception as e:  # shape mismatch, a kernel error: fatal, reported on every rank
        return f"applying {pid} failed: {type(e).__name__}: {e}"
    return None


def _rounds(ctx: CheckpointContext, fetcher: Fetcher, target, rounds: int, timings: list[float],
            fatal: Optional[str] = None) -> Optional[str]:
    """The ``rounds`` rounds of a pass, applying this rank's units to ``target``; adds to ``timings`` =
    [t_rollback, t_replay]; returns the error to report (carried into the next status gather)."""
    consensus = fetcher.consensus
    chain = fetcher.chain()
    ends = replay_ends(chain, consensus.end) if chain else []
    for k in range(rounds):
        t = time.perf_counter()
        pid, obj = fetcher.round(k, fatal)
        fatal = _apply(ctx, target, pid, obj, ends[k] if k < len(ends) else consensus.end) or fatal
        timings[min(k, 1)] += time.perf_counter() - t
    return fatal


def _fetch_and_replay(ctx: CheckpointContext, shard: ShardAccess, fetcher: Fetcher, plan: RankPlan,
                      timings: list[float]) -> Optional[dict]:
    """Restore this rank's shard to the consensus point: fetch and replay its own chain (a lost stage's ranks
    have none: CheckFree rebuilds them after), or (written by another layout) rebuild the old shards and
    reshard them (:mod:`.reshard`); then publish the parameters. Returns CheckFree's record, if it ran."""
    consensus = fetcher.consensus
    fetcher.reader.degrees = consensus.degrees
    checkfree = None
    if not consensus.resharded(ctx.layout.degrees):
        fetcher.owner = plan.passes[0] if ctx.rank not in fetcher.in_place else None
        fatal = _rounds(ctx, fetcher, shard, plan.rounds[0], timings)
        raise_fatal(ctx.comm.gather({"fatal": fatal}, what="the end of replay"), "replay")
        if consensus.lost_stages:
            t = time.perf_counter()
            checkfree = rebuild(ctx, shard, consensus)
            timings[1] += time.perf_counter() - t
    else:
        what = describe(consensus, ctx.layout.degrees)
        rebuilder = Rebuilder(shard.optimizer, shard.global_batch_size, fetcher.reader.layout_of)
        fatal = None
        for owner, rounds in zip(plan.passes, plan.rounds):
            fetcher.owner, rebuilder.current = owner, owner
            fatal = _rounds(ctx, fetcher, rebuilder, rounds, timings, fatal)
        raise_fatal(ctx.comm.gather({"fatal": fatal}, what=f"the end of replay ({what})"), f"replay ({what})")
        t = time.perf_counter()
        exchange(ctx.comm, rebuilder, shard, ctx.layout.tp_rank, ctx.layout.tp, what)
        timings[1] += time.perf_counter() - t
    t = time.perf_counter()
    shard.publish()
    timings[1] += time.perf_counter() - t
    return checkfree


def _in_place(ctx: CheckpointContext, shard: ShardAccess, plan: RankPlan) -> set[int]:
    """The ranks whose state in memory is already at the agreed end (an in-process recovery's survivors that
    finished step E and no more): they read and replay nothing, and the rounds are as many as the longest
    chain of the others. Never under resharding or a lost stage."""
    consensus = plan.consensus
    if consensus.resharded(ctx.layout.degrees) or consensus.lost_stages:
        return set()
    live = shard.live_version if shard.live_version is not None else -1
    rows = ctx.comm.gather_ints([live, len(consensus.chains.get(ctx.rank, []))], what="the survivors' steps")
    in_place = {r for r, (v, _) in enumerate(rows) if v == consensus.end}
    plan.rounds = [max((n for r, (_, n) in enumerate(rows) if r not in in_place), default=0)]
    return in_place


def _cleanup(ctx: CheckpointContext, servers: dict[str, int], end: int, corrupt: set) -> tuple[list[str], list[str]]:
    """Each tier's lister quarantines the units whose copies there failed their checks, and discards what could
    mix with the resumed run: units after E and leftovers. Returns (discarded, quarantined)."""
    gone: list[str] = []
    quarantined: list[str] = []
    for tier in listed_here(ctx, servers):
        for pid in sorted({c.pid for c in corrupt if c.tier == tier.label}):
            reasons = sorted(f"rank {c.owner}" for c in corrupt if c.tier == tier.label and c.pid == pid)
            if tier.quarantine(pid, f"{pid} failed its checksum at restore ({', '.join(reasons)})") is not None:
                quarantined.append(str(pid))
        gone += tier.discard_after(end)
    return gone, quarantined


def _replay_with_fallbacks(ctx: CheckpointContext, shard: ShardAccess, fetcher: Fetcher, plan: RankPlan,
                           whole: "_WholeInventory", timings: list[float]) -> tuple[Optional[dict], RankPlan]:
    """Fetch and replay; when a rank runs out of good copies, rank 0 agrees again without the bad ones on the
    whole inventory (a stage whose every copy turned out bad is lost: :mod:`.checkfree` may rebuild it).
    Returns CheckFree's record (if it ran) and the plan that was carried out."""
    while True:
        try:
            return _fetch_and_replay(ctx, shard, fetcher, plan, timings), plan
        except Exhausted as e:
            ledger = fetcher.ledger
            coordinator = whole.coordinator()
            decide_again = partial(coordinator.again, ledger.bad, str(e), ledger.fallbacks) if coordinator else None
            plan = coordinated(ctx.comm, decide_again, "the recovery plan without the bad copies")
            fetcher.consensus = plan.consensus
            ledger.served.clear()
            fetcher.in_place = set()  # the end may have moved: every rank restores from the copies


class _WholeInventory:
    """Rank 0's Coordinator over the whole inventory, taken (collectively) the first time it is needed: at once
    when the node summaries leave the decision to it, else only for a retry without bad copies."""

    def __init__(self, ctx: CheckpointContext, rank_nodes: list[str]):
        self.ctx, self.rank_nodes = ctx, rank_nodes
        self.taken = False
        self._coordinator: Optional[Coordinator] = None

    def coordinator(self) -> Optional[Coordinator]:
        if not self.taken:
            self.taken = True
            collected = take_inventory(self.ctx.comm, self.ctx.tiers, self.ctx.node, self.rank_nodes)
            self._coordinator = Coordinator(self.ctx, collected) if collected is not None else None
        return self._coordinator


def restore(ctx: CheckpointContext, shard: ShardAccess, *, allow_fresh_start: bool) -> Optional[RecoveryResult]:
    """Recover the newest state every rank can reach, or None for a fresh start; collective over all ranks."""
    t0 = time.perf_counter()
    rank_nodes = node_names(ctx.comm, ctx.node)
    servers = node_servers(rank_nodes)
    plan, listed = decide_by_nodes(ctx, rank_nodes, servers, allow_fresh_start, shard.live_version or 0)
    t_inventory = time.perf_counter() - t0
    whole = _WholeInventory(ctx, rank_nodes)
    if plan is None:
        coordinator = whole.coordinator()
        plan = coordinated(ctx.comm, partial(coordinator.first, allow_fresh_start) if coordinator else None,
                           "the recovery plan")
    if plan.consensus is None:
        return None
    t_consensus = time.perf_counter() - t0
    reader = Reader(ctx.node, ctx.job_id, plan.consensus.degrees, {t.label: t for t in ctx.tiers})
    fetcher = Fetcher(ctx.comm, reader, plan.consensus, rank_nodes)
    fetcher.in_place = _in_place(ctx, shard, plan)
    fetcher.ledger.fallbacks.extend(plan.notes)
    timings = [0.0, 0.0]
    checkfree, plan = _replay_with_fallbacks(ctx, shard, fetcher, plan, whole, timings)
    consensus = fetcher.consensus
    try:
        (deleted, quarantined), fatal = _cleanup(ctx, fetcher.servers, consensus.end, fetcher.ledger.corrupt), None
    except (StoreError, OSError) as e:
        deleted, quarantined = [], []
        fatal = f"cleanup after recovery failed: {e}; stale units could mix with the resumed run"
    ledger = fetcher.ledger
    coordinator = whole.coordinator() if whole.taken else None
    durable = (coordinator.durable(consensus.version, ledger.bad) if coordinator
               else durable_base(listed, consensus.version, ledger.bad))
    final = ctx.comm.gather({"fatal": fatal, "times": (t_consensus, *timings), "inventory_s": t_inventory,
                             "deleted": deleted, "quarantined": quarantined, "durable": durable},
                            what="the recovery cleanup")
    raise_fatal(final, "cleanup")
    record = _record(ctx, consensus, fetcher, plan, final, checkfree)
    history = appended(plan.history, version=consensus.version, end=consensus.end, level=plan.fallback.level)
    keepers = listed_here(ctx, fetcher.servers)
    for tier in keepers:
        tier.record_restores(history)
    return RecoveryResult(consensus.version, consensus.end, record, plan.adopted, history, keepers,
                          final[0]["durable"])


def _record(ctx: CheckpointContext, consensus: Consensus, fetcher: Fetcher, plan: RankPlan, final: list[dict],
            checkfree: Optional[dict]) -> dict:
    """The recovery record every rank builds from the same gathered facts; rank 0 logs its line."""
    ledger = fetcher.ledger
    record = recovery_record(consensus, ledger.served, ledger.moved, ledger.fallbacks,
                             times=[f["times"] for f in final], stale_removed=sum(len(f["deleted"]) for f in final),
                             tier1_present=plan.tier1_present, last_step=plan.last_step,
                             rank_nodes=fetcher.rank_nodes, inventory_s=max(f["inventory_s"] for f in final))
    record["quarantined"] = sorted({q for f in final for q in f["quarantined"]})
    record["ranks_in_place"] = sorted(fetcher.in_place)
    record["checkfree"] = checkfree
    if checkfree is not None:
        record["failure_class"] = "stage"  # whatever else was lost, a whole stage was
    record["exact"] = checkfree is None  # a rebuilt stage is not the state the run had
    resharded = consensus.resharded(ctx.layout.degrees)
    record["resharded"] = reshard_label(consensus.degrees, ctx.layout.degrees) if resharded else None
    record["adopted"] = plan.adopted
    record["fallback"] = plan.fallback.describe() if plan.fallback.level else None
    record["decided_by"] = plan.decided_by
    return record  # its console line (record.say_recovered) waits for the launch's own failure class
