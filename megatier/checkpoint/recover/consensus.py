"""Recovery consensus: the base V and the end E every rank can reach, and the cheapest copy of each unit.

Consensus (:func:`decide`; TierCheck, arXiv:2605.17821, section 3.3), a pure function of the
merged inventory, computed on rank 0, which sends each rank its part (:mod:`.plan`):
- V is the newest base version that *every* rank 0..world-1 has in some tier.
  The paper phrases it as a global minimum of per-rank maxima; taking the
  newest version in the intersection is the same thing when versions are
  saved in lock step and stays correct when one rank's newest base is missing
  on an older version.
- E is the furthest step that every rank reaches from V through a contiguous
  chain of units (diff batches and step units, each from any tier; a chain may
  stop inside a unit), i.e. the newest step in the intersection of the
  per-rank reachable steps (:mod:`..format.chain`).
- A pipeline stage none of whose ranks has a base in any tier is *lost*
  (:func:`lost_stages`). Then no base is common to every rank: recovery stops,
  naming the stage, unless ``checkpoint.last_resort=checkfree``, where V and E
  are agreed among the other ranks (:func:`agree_without_lost`) and the lost
  stage is rebuilt from its neighbours after they restored (:mod:`.checkfree`);
  :func:`checkfree_refusal` says when that cannot be done.
- Only copies of this job (and a configuration it may resume) count; each
  layout that wrote some is agreed on separately, the furthest E wins (see
  :func:`decide`). Copies of another job are set aside; if they are all there
  is, recovery is refused naming both (starting fresh over them would collide
  with their Tier-3 commit records).

Cascade (:func:`cascade`): a rank tries the copies of a unit in tier order as it
reaches them: its own node's memory, another node's memory, remote storage.

Why copies are keyed by their stamp: the stamp carries size, xxh64, job id and
layout, so whoever ends up serving a copy (the rank itself, another node's
server rank, a Tier-3 leader) can be checked against the inventory's record.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field, replace
from typing import Iterable, Optional

from megatier.checkpoint.format.chain import chain_to, reachable
from megatier.checkpoint.format.units import BASE, PayloadId
from megatier.checkpoint.recover.inventory import ConfigRefusal, RecoveryError
from megatier.checkpoint.tiers.base import TIER_ORDER, Copy
from megatier.config.fingerprint import changed_keys, recorded_value
from megatier.parallel.layout import coordinates_of

log = logging.getLogger(__name__)

LAYOUT_KEYS = ("parallel.",)  # fingerprint keys a relaunch may change: the state is resharded to the new layout


@dataclass
class Consensus:
    """The agreed recovery: base V, end E, each rank's unit chain and every usable copy of those units."""

    version: int
    end: int
    chains: dict[int, list[PayloadId]]  # by rank of the layout that wrote the units
    copies: dict[tuple[int, PayloadId], list[Copy]]
    ignored: list[str] = field(default_factory=list)
    degrees: tuple[int, int, int] = (1, 1, 1)  # (tp, pp, dp) of the layout that wrote the units
    lost_stages: tuple[int, ...] = ()  # pipeline stages with no base anywhere, rebuilt by CheckFree (no chains)
    # Written with another parallel.virtual_stages than this job's: same degrees, but each rank held other layers.
    chunks_moved: bool = False

    def resharded(self, degrees: tuple[int, int, int]) -> bool:
        """Whether a job of layout ``degrees`` restores this point through resharding."""
        return self.degrees != tuple(degrees) or self.chunks_moved

    def part(self, owners: Iterable[int]) -> "Consensus":
        """The same point with only the chains and copies of ``owners``: what a rank fetching them needs."""
        chains = {o: self.chains[o] for o in owners if o in self.chains}
        copies = {(o, pid): self.copies[(o, pid)] for o, chain in chains.items() for pid in chain}
        return replace(self, chains=chains, copies=copies)


@dataclass
class ConfigCheck:
    """Which config fingerprints this run may resume (megatier.config.fingerprint), and why not the others."""

    current_id: str  # "": the caller fingerprints nothing, so nothing is checked
    current: dict = field(default_factory=dict)
    known: dict[str, dict] = field(default_factory=dict)  # id -> fingerprint, as the tiers recorded them
    allow: tuple[str, ...] = ()  # checkpoint.allow_changes
    follow: tuple[str, ...] = ()  # keys this run takes from the record (megatier.config.fingerprint.followed_keys)

    def blocked(self, fingerprint_id: str) -> list[str]:
        """``key: old -> new`` for each change from ``fingerprint_id`` that this run may not make (the layout
        may always change: restore reshards)."""
        changes = changed_keys(self.known[fingerprint_id], self.current)
        free = (*self.allow, *self.follow)
        return [c for c in changes if c.split(":")[0] not in free and not c.startswith(LAYOUT_KEYS)]

    def virtual_stages(self, fingerprint_id: Optional[str] = None) -> int:
        """parallel.virtual_stages of the run that wrote units of ``fingerprint_id`` (None: this run's); 1 where
        nothing is recorded."""
        record = self.current if fingerprint_id is None else self.known.get(fingerprint_id, {})
        return int(json.loads(recorded_value(record, "parallel.virtual_stages") or "1"))

    def followed_values(self, consensus: "Consensus") -> dict[str, str]:
        """The followed keys' values as recorded with the consensus's base (empty when it has no record)."""
        if not self.follow:
            return {}
        base = PayloadId.base(consensus.version)
        ids = [c.stamp.fingerprint for (_, pid), cs in sorted(consensus.copies.items()) if pid == base for c in cs]
        record = next((self.known[i] for i in ids if i in self.known), None)
        return {k: record[k] for k in self.follow if record is not None and k in record}

    def refusal(self, fingerprint_id: str) -> Optional[str]:
        """None if units of ``fingerprint_id`` may be resumed, else what is wrong with them."""
        if not self.current_id or fingerprint_id == self.current_id or "*" in self.allow:
            return None
        if fingerprint_id not in self.known:
            return "a configuration with no record (written by an older MegaTier, or its record is lost)"
        blocked = self.blocked(fingerprint_id)
        return f"another configuration ({'; '.join(blocked)})" if blocked else None


def _foreign_reason(c: Copy, job_id: str, config: ConfigCheck) -> Optional[str]:
    s = c.stamp
    if s.job_id != job_id:
        return f"job {s.job_id!r}"
    return config.refusal(s.fingerprint)


def _refuse_changed_config(foreign: list[tuple[Copy, str]], job_id: str, config: ConfigCheck) -> ConfigRefusal:
    reasons = sorted({why for _, why in foreign})
    ids = {c.stamp.fingerprint for c, _ in foreign if c.stamp.fingerprint in config.known}
    keys = sorted({change.split(":")[0] for i in ids for change in config.blocked(i)})
    unknown = any(c.stamp.fingerprint not in config.known for c, _ in foreign)
    allow = f"checkpoint.allow_changes=[{','.join(keys)}]" if keys and not unknown else "checkpoint.allow_changes=['*']"
    return ConfigRefusal(
        f"refusing to recover: the checkpoints of job {job_id!r} were written with {' / '.join(reasons)}. Relaunch "
        f"with the configuration they were written with, use a new checkpoint.job_id (or logging.name) for a new "
        f"run, or set {allow} to resume them with these changes")


def _refuse_foreign(foreign: list[tuple[Copy, str]], job_id: str, config: ConfigCheck) -> ConfigRefusal:
    others = [(c, why) for c, why in foreign if c.stamp.job_id != job_id]
    if not others:
        return _refuse_changed_config(foreign, job_id, config)
    found = "; ".join(f"job {j!r}" for j in sorted({c.stamp.job_id for c, _ in others}))
    c = others[0][0]
    return ConfigRefusal(
        f"refusing to recover: the only checkpoints found belong to {found} (e.g. {c.pid} of rank {c.owner} in "
        f"{c.describe()}), but this job is {job_id!r}. A checkpoint cannot be loaded into another job: relaunch "
        f"with the job id it was written with, or use a new checkpoint.job_id")


def _missing_message(bases: list[set[int]], degrees: tuple[int, int, int], looked: str,
                     checkfree_blocked: str = "") -> str:
    world_size = math.prod(degrees)
    none = [r for r in range(world_size) if not bases[r]]
    newest = max((v for vs in bases for v in vs), default=None)
    parts = []
    if none:
        parts.append(f"ranks {none} have no base in any tier")
    if newest is not None:
        lacking = [r for r in range(world_size) if newest not in bases[r]]
        parts.append(f"the newest base v{newest} is missing for ranks {lacking}")
        held = {r: sorted(bases[r]) for r in range(world_size) if bases[r]}
        parts.append(f"bases found per rank: {held}")
    lost = lost_stages(bases, degrees)
    if lost:
        parts.append(f"pipeline stage(s) {lost} lost every copy: " + (
            checkfree_blocked or "checkpoint.last_resort=checkfree rebuilds an intermediate stage from its "
                                 "neighbours (not exact)"))
    return f"no base version is available for every rank ({'; '.join(parts)}). Looked in {looked}"


def by_layout(copies: Iterable[Copy], job_id: str, config: Optional[ConfigCheck] = None
              ) -> tuple[dict[tuple[int, int, int], list[Copy]], list[tuple[Copy, str]]]:
    """This job's copies by the layout (degrees) that wrote them, and the foreign ones with why (another job, a
    configuration ``config`` refuses, a rank outside its layout's world)."""
    config = config or ConfigCheck("")
    grouped: dict[tuple[int, int, int], list[Copy]] = {}
    foreign = []
    for c in copies:
        reason = _foreign_reason(c, job_id, config)
        degrees = c.stamp.layout.degrees
        world = math.prod(degrees)
        if reason is None and 0 <= c.owner < world:
            grouped.setdefault(degrees, []).append(c)
        else:
            foreign.append((c, reason or f"rank {c.owner} outside world {world}"))
    return grouped, foreign


def by_chunks(usable: list[Copy], config: ConfigCheck) -> dict[int, list[Copy]]:
    """One layout's copies by the parallel.virtual_stages that wrote them: each rank of one split held the same
    layers, so only copies of one split make a point."""
    parts: dict[int, list[Copy]] = {}
    chunks_of: dict[str, int] = {}  # per fingerprint: a point has one or two, a large world many copies
    for c in usable:
        fp = c.stamp.fingerprint
        if fp not in chunks_of:
            chunks_of[fp] = config.virtual_stages(fp)
        parts.setdefault(chunks_of[fp], []).append(c)
    return dict(sorted(parts.items()))


def _chunks_of(consensus: Consensus, config: ConfigCheck) -> int:
    """parallel.virtual_stages of the run that wrote ``consensus``'s units."""
    some = next(c for cs in consensus.copies.values() for c in cs)
    return config.virtual_stages(some.stamp.fingerprint)


def held_per_rank(usable: Iterable[Copy], world_size: int) -> tuple[list[set[int]], list[set[PayloadId]]]:
    """(base versions, diff batches and step units) held for each rank 0..world_size-1 of one layout."""
    bases: list[set[int]] = [set() for _ in range(world_size)]
    diffs: list[set[PayloadId]] = [set() for _ in range(world_size)]
    for c in usable:
        if c.pid.kind == BASE:
            bases[c.owner].add(c.pid.version)
        else:
            diffs[c.owner].add(c.pid)
    return bases, diffs


def consensus_at(usable: list[Copy], degrees: tuple[int, int, int], version: int, end: int,
                 lost: tuple[int, ...] = ()) -> Consensus:
    """Every rank's chain from base ``version`` to step ``end`` (which every rank must reach) and the usable
    copies of each of its units; the ranks of ``lost`` stages get no chain."""
    _, diffs = held_per_rank(usable, math.prod(degrees))
    chains = {r: chain_to(reachable(version, d), version, end) for r, d in enumerate(diffs)
              if stage_of(r, degrees) not in lost}
    by_unit: dict[tuple[int, PayloadId], list[Copy]] = {(r, pid): [] for r, ch in chains.items() for pid in ch}
    for c in usable:
        if (c.owner, c.pid) in by_unit:
            by_unit[(c.owner, c.pid)].append(c)
    return Consensus(version, end, chains, by_unit, degrees=degrees, lost_stages=tuple(lost))


def _agree_within(usable: list[Copy], degrees: tuple[int, int, int], lost: tuple[int, ...] = ()
                  ) -> Optional[Consensus]:
    """V, E and the chains among copies of one layout (the ranks of ``lost`` stages left out), or None when no
    base is common to all those ranks."""
    bases, diffs = held_per_rank(usable, math.prod(degrees))
    ranks = [r for r in range(len(bases)) if stage_of(r, degrees) not in lost]
    common = set.intersection(*(bases[r] for r in ranks))
    if not common:
        return None
    version = max(common)
    end = max(set.intersection(*(set(reachable(version, diffs[r])) for r in ranks)))
    return consensus_at(usable, degrees, version, end, lost)


def stage_of(rank: int, degrees: tuple[int, int, int]) -> int:
    tp, _, dp = degrees
    return coordinates_of(rank, tp=tp, dp=dp)[2]


def lost_stages(bases: list[set[int]], degrees: tuple[int, int, int]) -> list[int]:
    """The pipeline stages none of whose ranks holds a base in any tier (``bases``: per rank, :func:`held_per_rank`)."""
    pp = degrees[1]
    held = [False] * pp
    for rank, versions in enumerate(bases):
        held[stage_of(rank, degrees)] |= bool(versions)
    return [s for s in range(pp) if not held[s]] if any(held) else []


def checkfree_refusal(lost: list[int], pp: int) -> Optional[str]:
    """Why CheckFree cannot rebuild the ``lost`` stages, or None: it rebuilds a stage from its neighbours, so
    never two in a row (what else it needs, :func:`.checkfree.plan` checks with every stage's description)."""
    where = f"pipeline stage(s) {lost} of {pp} lost every copy in every tier"
    if pp < 2:
        return f"{where}; there is no other stage to rebuild it from"
    pairs = [(s, s + 1) for s in lost if s + 1 in lost]
    if pairs:
        return (f"{where}; CheckFree needs both neighbours of a lost stage, and stages "
                f"{', '.join(f'{a} and {b}' for a, b in pairs)} are consecutive. Restore one of them and relaunch")
    return None


def agree_without_lost(usable: list[Copy], degrees: tuple[int, int, int]) -> Optional[Consensus]:
    """checkpoint.last_resort=checkfree: the consensus of every rank outside the lost stages, with
    ``lost_stages`` set; None when no whole stage is lost or the others share no base either. Raises
    RecoveryError naming the stages when they are lost but CheckFree cannot rebuild them."""
    bases, _ = held_per_rank(usable, math.prod(degrees))
    lost = lost_stages(bases, degrees)
    if not lost:
        return None
    why = checkfree_refusal(lost, degrees[1])
    if why is not None:
        raise RecoveryError(f"refusing to recover with checkpoint.last_resort=checkfree: {why}")
    return _agree_within(usable, degrees, tuple(lost))


def fresh_without(unknown: list[str], known_traces: bool, job_id: str, allow_fresh_start: bool) -> bool:
    """Whether the launch starts fresh with a tier unlisted (``unknown``: why each was not; Tier-3 offline at
    start-up). When the tiers that were listed hold nothing of the job, nothing tells a new job from one whose
    checkpoints are only in the unlisted tier, and random weights would later overwrite them: refused in one
    line (ConfigRefusal) unless ``allow_fresh_start``. When they hold something, the launch restores from them
    (False) and Tier-3 catches up once it answers."""
    if not unknown:
        return False
    reason = "; ".join(unknown)
    if known_traces:
        log.warning("%s; this launch starts from node memory and uploads once Tier-3 answers (checkpointing "
                    "degraded until then)", reason)
        return False
    if not allow_fresh_start:
        raise ConfigRefusal(f"refusing to start job {job_id!r}: {reason}. Node memory holds nothing of the job, so "
                            f"this launch cannot tell a new job from one whose checkpoints are only in Tier-3; make "
                            f"Tier-3 reachable, or set checkpoint.allow_fresh_start=true to start from scratch")
    log.warning("%s; starting job %r from scratch (checkpoint.allow_fresh_start=true); it uploads once Tier-3 "
                "answers (checkpointing degraded until then)", reason, job_id)
    return True


def decide(copies: list[Copy], *, job_id: str, degrees: tuple[int, int, int], traces: bool, allow_fresh_start: bool,
           looked: str, config: Optional[ConfigCheck] = None, last_resort: str = "stop") -> Optional[Consensus]:
    """The recovery point all ranks agree on, or None for a fresh start (nothing of this job exists).

    Each layout that wrote copies of this job is agreed on separately (V and E need every rank *of that
    layout*); the furthest E wins, this job's own layout on a tie, so a job relaunched on another layout
    resumes the old layout's state (resharded by restore) until its own units reach further.

    Raises RecoveryError when traces exist but no layout has a base for every one of its ranks (unless
    ``last_resort="checkfree"`` and whole stages of this job's layout are lost: :func:`agree_without_lost`;
    or ``allow_fresh_start``: then a warning and None), and always when the only checkpoints found are of
    another job or configuration.
    """
    if not traces:
        return None
    config = config or ConfigCheck("")
    grouped, foreign = by_layout(copies, job_id, config)
    agreed = [c for d, usable in grouped.items() for part in by_chunks(usable, config).values()
              if (c := _agree_within(part, d)) is not None]
    for c in agreed:
        c.chunks_moved = _chunks_of(c, config) != config.virtual_stages()
    blocked = ""
    if not agreed and last_resort == "checkfree" and degrees in grouped:
        # CheckFree rebuilds in place: only copies written with this job's model chunks hold its stages' layers.
        splits, v = by_chunks(grouped[degrees], config), config.virtual_stages()
        agreed = [c for c in [agree_without_lost(splits.get(v, []), degrees)] if c is not None]
        if v not in splits:
            blocked = (f"CheckFree rebuilds a stage in place from copies of this job's parallel.virtual_stages={v}, "
                       f"but they were written with virtual_stages={sorted(splits)}: relaunch with that value")
    if not agreed:
        if foreign:
            raise _refuse_foreign(foreign, job_id, config)
        shown = degrees if degrees in grouped or not grouped else max(grouped, key=lambda d: len(grouped[d]))
        bases, _ = held_per_rank(grouped.get(shown, []), math.prod(shown))
        message = _missing_message(bases, shown, looked, blocked)
        if allow_fresh_start:
            log.warning("starting fresh because checkpoint.allow_fresh_start is set, although: %s", message)
            return None
        raise RecoveryError(f"{message}. Refusing to start from random weights; set "
                            f"checkpoint.allow_fresh_start=true to start from scratch anyway")
    best = max(agreed, key=lambda c: (c.end, not c.resharded(degrees), c.version))
    best.ignored = [f"{c.pid} of rank {c.owner} in {c.describe()}: {why}" for c, why in foreign]
    if best.ignored:
        log.warning("recovery ignores %d copies of another job or config, e.g. %s", len(best.ignored),
                    best.ignored[0])
    return best


def cascade(copies: Iterable[Copy], node: str) -> list[Copy]:
    """Cheapest source first for a rank on ``node``, in tier order as the rank reaches them: its node's
    memory (own, then replica area), another node's memory (by node name), Tier-3. Copies with identical
    bytes on several nodes are alternatives."""
    return sorted(copies, key=lambda c: (TIER_ORDER.index(c.reach(node)), c.node or "", c.replica))
