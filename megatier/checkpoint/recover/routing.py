"""After the decision from summaries (:mod:`.summary`): the copies go to the nodes that fetch them, and each
node's leader cuts its ranks' plans.

The decider sends every leader the :class:`.summary.Point` (V, E, each owner
span's chain and its holders), O(nodes) bytes. Each holder's leader then sends
the copies (stamps) of the agreed units it listed to the leader of the node
whose rank fetches them (:func:`route`; in the job's own layout rank ``o``
fetches owner ``o``'s chain), and every leader knows from the point whom it
receives from (:func:`senders`). A leader so receives the copies of its own
ranks' units only, O(its ranks' units x holders), and cuts each of its ranks
the :class:`.plan.RankPlan` the decider used to cut (:func:`plans_for`): the
same chains, the same copies in the same order, so the cascade runs as before.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Optional, Sequence

from megatier.checkpoint.recover.consensus import Consensus
from megatier.checkpoint.recover.plan import RankPlan
from megatier.checkpoint.recover.summary import Point
from megatier.checkpoint.tiers.base import TIER_ORDER, Copy


def fetchers(point: Point, lo: int, hi: int) -> dict[int, tuple]:
    """Owner -> its chain, for the owners ``lo`` .. ``hi`` - 1."""
    return {o: span.chain for span in point.spans_of(lo, hi) for o in range(max(span.lo, lo), min(span.hi, hi))}


def route(point: Point, copies: Iterable[Copy], rank_nodes: Sequence[str]) -> dict[str, list[Copy]]:
    """A holder's copies of the agreed units, by the node whose rank fetches them (the owner's rank in the
    job's own layout), in the order the holder listed them."""
    out: dict[str, list[Copy]] = {}
    cache: dict[int, frozenset] = {}
    for c in copies:
        units = cache.get(c.owner)
        if units is None:
            spans = point.spans_of(c.owner, c.owner + 1)
            units = cache[c.owner] = frozenset(spans[0].chain) if spans else frozenset()
        if c.pid in units and c.owner < len(rank_nodes):
            out.setdefault(rank_nodes[c.owner], []).append(c)
    return out


def senders(point: Point, ranks: Sequence[int]) -> list[tuple[str, Optional[str]]]:
    """The holders (tier, node; node None: remote storage) that send copies to the leader of ``ranks``."""
    found: set[tuple[str, Optional[str]]] = set()
    for r in ranks:
        for span in point.spans_of(r, r + 1):
            found.update(span.holders)
    return sorted(found, key=_where_order)


def _where_order(where: tuple[str, Optional[str]]) -> tuple[int, str]:
    tier, node = where
    return TIER_ORDER.index(tier), node or ""


def plans_for(point: Point, ranks: Sequence[int], received: Iterable[Copy], shared: RankPlan) -> list[RankPlan]:
    """The plans of ``ranks`` (one node's, in the job's own layout) from the copies their leader received:
    each rank's chain and the copies of its units in the merged inventory's order (tier, then node, then as
    listed), ``shared``'s facts, one pass of ``point.rounds`` rounds."""
    chains: dict[int, list] = {}
    for r in ranks:
        chains.update((o, list(chain)) for o, chain in fetchers(point, r, r + 1).items())
    by_unit: dict[tuple, list[Copy]] = {(r, pid): [] for r, chain in chains.items() for pid in chain}
    for c in sorted(received, key=lambda c: _where_order((c.tier, c.node))):
        slot = by_unit.get((c.owner, c.pid))
        if slot is not None:
            slot.append(c)
    rounds = [point.rounds]
    plans = []
    for r in ranks:
        chain = chains.get(r)
        part = Consensus(point.version, point.end, {r: chain} if chain else {},
                         {(r, pid): by_unit[(r, pid)] for pid in chain or []}, degrees=point.degrees)
        plans.append(replace(shared, consensus=part, passes=[r if chain else None], rounds=rounds))
    return plans
