"""Recovery inventory and consensus: which copies of which units exist where, and what every rank can reach.

Listing (collective-free, called by :mod:`megatier.checkpoint.recover.restore`):
:func:`list_node` reads one node's Tier-1 area (own and replica areas of every
owner, complete entries only) and its progress keys; :func:`list_remote` reads
Tier-3's committed units once. Every rank then holds the same all-gathered
reports, so the pure functions below give every rank the same answer without
further messages.

Consensus (:func:`decide`, DESIGN.md section 4 and 000_*.txt section 3.3):
- V is the newest base version that *every* rank 0..world-1 has in some tier.
  The paper phrases it as a global minimum of per-rank maxima; taking the
  newest version in the intersection is the same thing when versions are
  saved in lock step and stays correct when one rank's newest base is missing
  on an older version.
- E is the furthest step that every rank reaches from V through a contiguous
  chain of whole diff batches (each from any tier), i.e. the newest end in the
  intersection of the per-rank reachable ends.
- Only copies of this job and layout count. Copies of another job or layout
  are set aside; if they are all there is, recovery is refused naming both
  (starting fresh over them would collide with their Tier-3 commit records).

Why copies are keyed by their stamp: the stamp carries size, xxh64, job id and
layout, so whoever ends up serving a copy (the rank itself, another node's
server rank, a Tier-3 leader) can be checked against the inventory's record.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Optional

from megatier.checkpoint.commit.records import COMMITTED, CommitRecord, commit_key, list_units
from megatier.checkpoint.tiers.node_memory import LocalTier
from megatier.checkpoint.format.units import BASE, PayloadId, parse_rank_name
from megatier.checkpoint.format.payload import PayloadError, Stamp
from megatier.checkpoint.tiers.store import ObjectStore, StoreError

log = logging.getLogger(__name__)

TIER1, TIER2, TIER3 = "tier1", "tier2", "tier3"
PROGRESS_PREFIX = "progress/"


class RecoveryError(RuntimeError):
    """Recovery cannot produce a consistent state; raised on every rank with the same message."""


@dataclass(frozen=True)
class Copy:
    """One complete copy of a rank's unit: in a node's Tier-1 area (own or replica), or committed on Tier-3."""

    stamp: Stamp
    node: Optional[str]  # None: Tier-3
    replica: bool = False

    @property
    def owner(self) -> int:
        return self.stamp.rank

    @property
    def pid(self) -> PayloadId:
        return self.stamp.pid

    def tier_for(self, node: str) -> str:
        """Tier label seen from a rank on ``node``: its own node's memory, another node's, or remote."""
        if self.node is None:
            return TIER3
        return TIER1 if self.node == node else TIER2

    def describe(self) -> str:
        if self.node is None:
            return "Tier-3"
        return f"{self.node} {'replica' if self.replica else 'own'} area"


@dataclass
class NodeReport:
    """What one rank found in its node's Tier-1 area; every rank of a node lists the same area."""

    rank: int
    node: str
    copies: list[Copy] = field(default_factory=list)
    incomplete: int = 0
    progress: dict[int, int] = field(default_factory=dict)


@dataclass
class RemoteReport:
    """Tier-3 as listed once by rank 0: readable commit records, uncommitted units, skipped records."""

    url: Optional[str] = None
    committed: list[CommitRecord] = field(default_factory=list)
    uncommitted: list[PayloadId] = field(default_factory=list)
    any_objects: bool = False
    notes: list[str] = field(default_factory=list)


def list_node(local: Optional[LocalTier], rank: int, node: str) -> NodeReport:
    """List ``node``'s whole Tier-1 area (every owner, own and replica) and its progress keys."""
    report = NodeReport(rank, node)
    if local is None:
        return report
    for replica in (False, True):
        report.incomplete += sum(1 for e in local.entries(replica=replica) if not e.complete)
        report.copies.extend(Copy(s, node, replica) for s in local.list(replica=replica))
    for key in local.store.list(PROGRESS_PREFIX):
        owner = parse_rank_name(key[len(PROGRESS_PREFIX):])
        try:
            step = int(local.store.get(key).decode())
        except (StoreError, ValueError, UnicodeDecodeError) as e:
            log.warning("ignoring progress key %s: %s", local.store.describe(key), e)
            continue
        if owner is not None:
            report.progress[owner] = step
    return report


def list_remote(store: Optional[ObjectStore]) -> RemoteReport:
    """Tier-3's units: commit records of committed ones (unreadable records are noted and skipped)."""
    if store is None:
        return RemoteReport()
    report = RemoteReport(url=store.url)
    units = list_units(store)
    report.any_objects = bool(units)
    for pid, unit in sorted(units.items(), key=lambda kv: (kv[0].last, kv[0].kind)):
        if not unit.committed:
            report.uncommitted.append(pid)
            continue
        key = commit_key(pid)
        try:
            record = CommitRecord.from_json(store.get(key), store.describe(key))
        except (PayloadError, StoreError) as e:
            report.notes.append(f"Tier-3 {pid}: {COMMITTED} unreadable ({e})")
            continue
        if record.pid != pid:
            report.notes.append(f"Tier-3 {pid}: {COMMITTED} describes {record.pid}")
            continue
        report.committed.append(record)
    return report


def collect_copies(nodes: Iterable[NodeReport], remote: RemoteReport) -> list[Copy]:
    """Every copy from the nodes' reports and every rank's object of every committed Tier-3 unit."""
    copies = [c for n in nodes for c in n.copies]
    copies += [Copy(m.stamp, None) for record in remote.committed for m in record.ranks]
    return copies


def has_traces(nodes: Iterable[NodeReport], remote: RemoteReport) -> bool:
    """Whether anything of this job exists: a Tier-1 file, a progress key, or any Tier-3 object."""
    return remote.any_objects or any(n.copies or n.incomplete or n.progress for n in nodes)


def _layout_str(degrees: tuple[int, int, int]) -> str:
    return "tp={} pp={} dp={}".format(*degrees)


@dataclass
class Consensus:
    """The agreed recovery: base V, end E, each rank's unit chain and every usable copy of those units."""

    version: int
    end: int
    chains: dict[int, list[PayloadId]]
    copies: dict[tuple[int, PayloadId], list[Copy]]
    ignored: list[str] = field(default_factory=list)


def _foreign_reason(c: Copy, job_id: str, degrees: tuple[int, int, int]) -> Optional[str]:
    s = c.stamp
    if s.job_id != job_id:
        return f"job {s.job_id!r}"
    if s.layout.degrees != degrees:
        return f"layout {_layout_str(s.layout.degrees)}"
    return None


def _refuse_foreign(foreign: list[tuple[Copy, str]], job_id: str, degrees: tuple[int, int, int]) -> RecoveryError:
    kinds = sorted({(c.stamp.job_id, c.stamp.layout.degrees) for c, _ in foreign})
    found = "; ".join(f"job {j!r} with layout {_layout_str(d)}" for j, d in kinds)
    c = foreign[0][0]
    return RecoveryError(
        f"refusing to recover: the only checkpoints found belong to {found} (e.g. {c.pid} of rank {c.owner} in "
        f"{c.describe()}), but this job is {job_id!r} with layout {_layout_str(degrees)}. A checkpoint cannot be "
        f"loaded into another job or layout: relaunch with the job id and layout it was written with, or use a "
        f"new checkpoint.job_id")


def _missing_message(bases: dict[int, set[int]], world_size: int, looked: str) -> str:
    none = [r for r in range(world_size) if not bases[r]]
    newest = max((v for vs in bases.values() for v in vs), default=None)
    parts = []
    if none:
        parts.append(f"ranks {none} have no base in any tier")
    if newest is not None:
        lacking = [r for r in range(world_size) if newest not in bases[r]]
        parts.append(f"the newest base v{newest} is missing for ranks {lacking}")
        held = {r: sorted(bases[r]) for r in range(world_size) if bases[r]}
        parts.append(f"bases found per rank: {held}")
    return (f"no base version is available for every rank ({'; '.join(parts)}). Looked in {looked}. Refusing to "
            f"start from random weights; set checkpoint.allow_fresh_start=true to start from scratch anyway")


def _reachable(version: int, batches: Iterable[PayloadId]) -> dict[int, Optional[PayloadId]]:
    """Ends reachable from ``version`` through contiguous batches -> the batch that reaches each end."""
    reach: dict[int, Optional[PayloadId]] = {version: None}
    for pid in sorted(batches, key=lambda p: (p.first, p.last)):
        if pid.first > version and pid.first - 1 in reach and pid.last not in reach:
            reach[pid.last] = pid
    return reach


def decide(copies: list[Copy], *, job_id: str, degrees: tuple[int, int, int], world_size: int, traces: bool,
           allow_fresh_start: bool, looked: str) -> Optional[Consensus]:
    """The recovery point all ranks agree on, or None for a fresh start (nothing of this job exists).

    Raises RecoveryError when traces exist but some rank has no base anywhere
    (unless ``allow_fresh_start``: then a warning and None), and always when the
    only checkpoints found are of another job or layout.
    """
    if not traces:
        return None
    usable, foreign = [], []
    for c in copies:
        reason = _foreign_reason(c, job_id, degrees)
        if reason is None and 0 <= c.owner < world_size:
            usable.append(c)
        else:
            foreign.append((c, reason or f"rank {c.owner} outside world {world_size}"))
    bases: dict[int, set[int]] = {r: set() for r in range(world_size)}
    diffs: dict[int, set[PayloadId]] = {r: set() for r in range(world_size)}
    for c in usable:
        (bases if c.pid.kind == BASE else diffs)[c.owner].add(c.pid.version if c.pid.kind == BASE else c.pid)
    common = set.intersection(*bases.values()) if world_size else set()
    if not common:
        if foreign:
            raise _refuse_foreign(foreign, job_id, degrees)
        message = _missing_message(bases, world_size, looked)
        if allow_fresh_start:
            log.warning("starting fresh because checkpoint.allow_fresh_start is set, although: %s", message)
            return None
        raise RecoveryError(message)
    version = max(common)
    reach = {r: _reachable(version, diffs[r]) for r in range(world_size)}
    end = max(set.intersection(*(set(x) for x in reach.values())))
    chains: dict[int, list[PayloadId]] = {}
    for r in range(world_size):
        chain, e = [], end
        while e != version:
            pid = reach[r][e]
            chain.append(pid)
            e = pid.first - 1
        chains[r] = [PayloadId.base(version)] + chain[::-1]
    needed = {(r, pid) for r, chain in chains.items() for pid in chain}
    by_unit: dict[tuple[int, PayloadId], list[Copy]] = {key: [] for key in needed}
    for c in usable:
        if (c.owner, c.pid) in by_unit:
            by_unit[(c.owner, c.pid)].append(c)
    ignored = [f"{c.pid} of rank {c.owner} in {c.describe()}: {why}" for c, why in foreign]
    if ignored:
        log.warning("recovery ignores %d copies of another job or layout, e.g. %s", len(ignored), ignored[0])
    return Consensus(version, end, chains, by_unit, ignored)


def _node_key(name: Optional[str]) -> str:
    return name or ""


def cascade(copies: Iterable[Copy], node: str) -> list[Copy]:
    """Cheapest source first for a rank on ``node``: its node's memory (own, then replica area), another
    node's memory (by node name), Tier-3. Copies with identical bytes on several nodes are alternatives."""
    order = {TIER1: 0, TIER2: 1, TIER3: 2}
    return sorted(copies, key=lambda c: (order[c.tier_for(node)], _node_key(c.node), c.replica))


def failure_class(served: dict[tuple[int, PayloadId], tuple[str, int]], tier1_present: bool) -> str:
    """Inferred from where the units came from: all from the ranks' own nodes -> software; some from other
    nodes' memory and none from Tier-3 -> node; any from Tier-3 -> rack without any Tier-1 data, else mixed."""
    tiers = {tier for tier, _ in served.values()}
    if tiers <= {TIER1}:
        return "software"
    if TIER3 not in tiers:
        return "node"
    return "mixed" if tier1_present else "rack"


def recovery_record(consensus: Consensus, served: dict[tuple[int, PayloadId], tuple[str, int]],
                    moved: dict[str, int], fallbacks: list[str], *, times: list[tuple[float, float, float]],
                    stale_removed: int, tier1_present: bool, last_step: Optional[int],
                    rank_nodes: Optional[list[str]] = None) -> dict:
    """The metrics record of a recovery; ``served[(rank, unit)] = (tier, bytes)`` of the pass that succeeded,
    ``moved`` the verified bytes per tier over all passes, ``times`` each rank's (consensus, rollback, replay):
    the record reports the slowest rank, since the job resumes when the last rank does.
    ``source_tiers`` counts ranks by where their base came from; ``rank_tiers[r]`` lists every tier
    rank r's units (base and diffs) came from, next to ``rank_nodes[r]``, the node rank r ran on."""
    source_tiers = {TIER1: 0, TIER2: 0, TIER3: 0}
    per_rank: dict[int, set[str]] = {}
    for (rank, pid), (tier, _) in served.items():
        per_rank.setdefault(rank, set()).add(tier)
        if pid == PayloadId.base(consensus.version):
            source_tiers[tier] += 1
    return {
        "event": "recovery",
        "failure_class": failure_class(served, tier1_present),
        "source_tiers": source_tiers,
        "rank_tiers": [sorted(per_rank.get(r, ())) for r in range(max(per_rank, default=-1) + 1)],
        "rank_nodes": list(rank_nodes) if rank_nodes is not None else None,
        "version": consensus.version,
        "end": consensus.end,
        "t_consensus_s": max(t[0] for t in times),
        "t_rollback_s": max(t[1] for t in times),
        "t_replay_s": max(t[2] for t in times),
        "bytes_tier1": moved.get(TIER1, 0),
        "bytes_tier2": moved.get(TIER2, 0),
        "bytes_tier3": moved.get(TIER3, 0),
        "last_step": last_step,
        "steps_lost": max(0, last_step - consensus.end) if last_step is not None else None,
        "fallbacks": list(fallbacks),
        "ignored_foreign_copies": len(consensus.ignored),
        "stale_units_removed": stale_removed,
    }
