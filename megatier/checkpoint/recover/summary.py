"""The recovery's decision from per-node summaries: O(nodes) for the decider, not O(world).

Rank 0 used to receive every copy of every rank's units (their stamps), merge
them, agree on V and E and cut one plan per rank: O(world) bytes, memory and
CPU on one process (66 s and about 1 GiB at 98,304 ranks,
docs/benchmarks.md). The decision needs far less: which units each rank has
somewhere. A node's memory holds the same units for all the ranks whose
copies it keeps (its own and its ring predecessor's), so a node's *leader*
(its server rank) sends the decider a :class:`Holding` per kind of copy:
the tier and node holding it, the job, config and layout that wrote it, the
units, and the owners it holds them for, as ranges. A node's summary is a few
holdings whatever its size.

:func:`agree` is the consensus on those holdings: a sweep over the owner ranges
unites what each rank has in every tier, and V and E are agreed per distinct
union (usually one or two), in O(holdings log holdings). Its :class:`Point`
(V, E, the layout, each owner range's chain) is all the others need: each
holder sends the copies of the agreed units to the node whose ranks fetch them
(:mod:`.routing`), and that node's leader cuts its ranks' plans there.

The fast path covers the common recovery: one layout of this job, the same
config, every rank holding a base. Anything else (several layouts or configs,
copies of another job, ranks with nothing, lost stages, a restore loop,
resharding) makes :func:`agree` answer None, and the full consensus of
:mod:`.consensus` decides on the merged inventory as before, with its messages.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Iterable, Optional, Sequence

from megatier.checkpoint.format.chain import chain_to, reachable
from megatier.checkpoint.format.units import BASE, PayloadId
from megatier.checkpoint.recover.consensus import ConfigCheck
from megatier.checkpoint.tiers.base import Copy, Listing

Range = tuple[int, int]  # owners lo .. hi - 1


@dataclass(frozen=True)
class Holding:
    """The units ``pids`` one holder (``tier`` on ``node``; None: remote storage) has of every owner in
    ``owners``, written by job ``job_id`` with config ``fingerprint`` in layout ``degrees``."""

    tier: str
    node: Optional[str]
    job_id: str
    fingerprint: str
    degrees: tuple[int, int, int]
    pids: tuple[PayloadId, ...]  # sorted
    owners: tuple[Range, ...]

    @property
    def where(self) -> tuple[str, Optional[str]]:
        return self.tier, self.node


@dataclass
class Summary:
    """What one lister sends the decider instead of its listings: its holdings, and each listing's node-wide
    facts (traces, progress, fingerprints, notes, the restore history) without its copies."""

    holdings: list[Holding]
    facts: dict[str, Listing] = field(default_factory=dict)  # tier label -> the listing without copies


@dataclass(frozen=True)
class Span:
    """Owners ``lo`` .. ``hi`` - 1: the chain each fetches and where copies of its units are."""

    lo: int
    hi: int
    chain: tuple[PayloadId, ...]
    holders: tuple[tuple[str, Optional[str]], ...]  # (tier, node) of every holder of some unit of the chain


@dataclass(frozen=True)
class Point:
    """The agreed recovery, as the decider sends it: base V, end E, the layout that wrote the units, and the
    chain of every owner (by span)."""

    version: int
    end: int
    degrees: tuple[int, int, int]
    spans: tuple[Span, ...]

    @property
    def rounds(self) -> int:
        return max((len(s.chain) for s in self.spans), default=0)

    def spans_of(self, lo: int, hi: int) -> list[Span]:
        """The spans of owners ``lo`` .. ``hi`` - 1 (binary search: spans are sorted and do not overlap)."""
        spans = self.spans
        a, b = 0, len(spans)
        while a < b:
            mid = (a + b) // 2
            if spans[mid].hi <= lo:
                a = mid + 1
            else:
                b = mid
        out = []
        while a < len(spans) and spans[a].lo < hi:
            out.append(spans[a])
            a += 1
        return out


def part(point: Point, owners: Iterable[Range]) -> Point:
    """The spans a leader needs: those of the owners it holds copies of (it routes them) and of its own ranks
    (it cuts their plans and knows from them whom it hears from). O(its ranges), whatever the world."""
    spans = {s for lo, hi in owners for s in point.spans_of(lo, hi)}
    return replace(point, spans=tuple(sorted(spans, key=lambda s: s.lo)))


def ranges(owners: Iterable[int]) -> tuple[Range, ...]:
    """Sorted owners as maximal half-open ranges."""
    out: list[list[int]] = []
    for o in sorted(set(owners)):
        if out and out[-1][1] == o:
            out[-1][1] = o + 1
        else:
            out.append([o, o + 1])
    return tuple((lo, hi) for lo, hi in out)


def holdings_of(copies: Iterable[Copy]) -> list[Holding]:
    """The copies of one listing as holdings: owners with the same units from the same writer share one."""
    held: dict[tuple, set[PayloadId]] = {}
    for c in copies:
        s = c.stamp
        held.setdefault((c.tier, c.node, s.job_id, s.fingerprint, s.layout.degrees, c.owner), set()).add(c.pid)
    kinds: dict[tuple, list[int]] = {}
    for (*where, owner), pids in held.items():
        kinds.setdefault((*where, tuple(sorted(pids))), []).append(owner)
    return [Holding(*key, owners=ranges(owners)) for key, owners in kinds.items()]


def summarize(listings: dict[str, Listing]) -> Summary:
    """A leader's summary of the listings it made (tier label -> listing). Progress is kept as its newest
    step only (:func:`.inventory.last_step` needs no more)."""
    holdings = [h for listing in listings.values() for h in holdings_of(listing.copies)]
    facts = {}
    for label, listing in listings.items():
        newest = max(listing.progress.items(), key=lambda kv: kv[1], default=None)
        facts[label] = Listing(traces=listing.traces, unknown=listing.unknown, incomplete=listing.incomplete,
                               progress=dict([newest]) if newest else {}, fingerprints=listing.fingerprints,
                               notes=listing.notes, restores=listing.restores)
    return Summary(holdings, facts)


def interned(holdings: Iterable[Holding], table: dict) -> list[Holding]:
    """``holdings`` with equal unit tuples shared through ``table``: the decider keeps a few holdings per node,
    and most hold the same units."""
    return [replace(h, pids=table.setdefault(h.pids, h.pids)) for h in holdings]


def _sweep(holdings: Sequence[Holding], world: int) -> Optional[list[tuple[int, int, frozenset[int]]]]:
    """The owners 0 .. world-1 cut into pieces covered by the same holdings (by index); None when an owner
    range leaves the world or some owner is held nowhere."""
    events: dict[int, list[tuple[int, int]]] = {}
    for i, h in enumerate(holdings):
        for lo, hi in h.owners:
            if lo < 0 or hi > world:
                return None
            events.setdefault(lo, []).append((1, i))
            events.setdefault(hi, []).append((-1, i))
    active: set[int] = set()
    pieces, cuts = [], sorted(events)
    for at, nxt in zip(cuts, cuts[1:] + [world]):
        for sign, i in events[at]:
            (active.add if sign > 0 else active.discard)(i)
        if at < nxt:
            if not active:
                return None
            pieces.append((at, nxt, frozenset(active)))
    if not pieces or pieces[0][0] != 0 or pieces[-1][1] != world:
        return None
    return pieces


class _Unions:
    """What the owners of each piece hold in every tier, computed once per distinct set of unit tuples (the
    holdings' tuples are shared: :func:`interned`), so the decider hashes a few units per kind, not per node."""

    def __init__(self, holdings: Sequence[Holding]):
        self.holdings = holdings
        self.memo: dict[frozenset[int], frozenset[PayloadId]] = {}
        self.overlap: dict[tuple[int, int], bool] = {}

    def of(self, cover: frozenset[int]) -> frozenset[PayloadId]:
        key = frozenset(id(self.holdings[i].pids) for i in cover)
        held = self.memo.get(key)
        if held is None:
            held = self.memo[key] = frozenset(p for i in cover for p in self.holdings[i].pids)
        return held

    def serves(self, i: int, units: frozenset[PayloadId]) -> bool:
        """Whether holding ``i`` has some of ``units``."""
        pids = self.holdings[i].pids
        key = (id(pids), id(units))
        hit = self.overlap.get(key)
        if hit is None:
            hit = self.overlap[key] = not units.isdisjoint(pids)
        return hit


def agree(holdings: Iterable[Holding], *, job_id: str, config: Optional[ConfigCheck] = None) -> Optional[Point]:
    """The consensus of :func:`.consensus.decide` on the holdings of every lister, when it is the common case
    (see the module docstring); None when the full consensus must decide. Pure."""
    config = config or ConfigCheck("")
    holdings = list(holdings)
    refused = {fp for fp in {h.fingerprint for h in holdings} if config.refusal(fp) is not None}
    if any(h.job_id != job_id or h.fingerprint in refused for h in holdings):
        return None
    if any(config.virtual_stages(h.fingerprint) != config.virtual_stages() for h in holdings):
        return None  # written with other model chunks per rank: the full consensus splits and reshards
    layouts = {h.degrees for h in holdings}
    if len(layouts) != 1:
        return None
    degrees = layouts.pop()
    pieces = _sweep(holdings, math.prod(degrees))
    if pieces is None:
        return None
    unions = _Unions(holdings)
    held = [unions.of(cover) for _, _, cover in pieces]  # what each piece's owners have in every tier
    distinct = set(held)
    common = set.intersection(*({p.version for p in u if p.kind == BASE} for u in distinct))
    if not common:
        return None
    version = max(common)
    reach = {u: reachable(version, [p for p in u if p.kind != BASE]) for u in distinct}
    end = max(set.intersection(*(set(r) for r in reach.values())))
    chains = {u: tuple(chain_to(r, version, end)) for u, r in reach.items()}
    units = {u: frozenset(chain) for u, chain in chains.items()}
    spans = []
    for (lo, hi, cover), u in zip(pieces, held):
        holders = {holdings[i].where for i in cover if unions.serves(i, units[u])}
        spans.append(Span(lo, hi, chains[u], tuple(sorted(holders, key=lambda w: (w[0], w[1] or "")))))
    return Point(version, end, degrees, tuple(spans))
