"""The recovery record: what restore did, for metrics.jsonl, wandb and the failure drill's report."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from megatier.checkpoint.recover.consensus import Consensus
from megatier.checkpoint.tiers.base import TIER1, TIER2, TIER3, TIER_ORDER

log = logging.getLogger(__name__)


@dataclass
class Sources:
    """Where each old rank's units came from, folded in as the status gathers bring them: the tiers of each
    rank's units (a bit per tier) and the tier of its base. That is all the record reads, so every rank keeps
    a few bytes per rank of the world rather than an entry per unit."""

    tiers: dict[int, int] = field(default_factory=dict)  # rank -> bit i set: a unit came from TIER_ORDER[i]
    base: dict[int, str] = field(default_factory=dict)  # rank -> the tier its base came from

    def add(self, rank: int, base: bool, tier: str) -> None:
        """Rank ``rank``'s unit (its base when ``base``) came from ``tier``."""
        self.tiers[rank] = self.tiers.get(rank, 0) | 1 << TIER_ORDER.index(tier)
        if base:
            self.base[rank] = tier

    def clear(self) -> None:
        self.tiers.clear()
        self.base.clear()

    def of(self, rank: int) -> list[str]:
        """The tiers rank ``rank``'s units came from, in tier order."""
        mask = self.tiers.get(rank, 0)
        return [t for i, t in enumerate(TIER_ORDER) if mask >> i & 1]

    def used(self) -> set[str]:
        mask = 0
        for m in self.tiers.values():
            mask |= m
        return {t for i, t in enumerate(TIER_ORDER) if mask >> i & 1}


def failure_class(used: set[str], tier1_present: bool) -> str:
    """Inferred from the tiers the units came from (``used``): all from the ranks' own nodes -> software; some
    from other nodes' memory and none from Tier-3 -> node; any from Tier-3 -> rack without any Tier-1 data, else
    mixed."""
    if used <= {TIER1}:
        return "software"
    if TIER3 not in used:
        return "node"
    return "mixed" if tier1_present else "rack"


def recovery_record(consensus: Consensus, sources: Sources, moved: dict[str, int], fallbacks: list[str], *,
                    times: list[tuple[float, float, float]], stale_removed: int, tier1_present: bool,
                    last_step: Optional[int],
                    rank_nodes: Optional[list[str]] = None, inventory_s: float = 0.0) -> dict:
    """The metrics record of a recovery; ``sources`` where the units of the pass that succeeded came from,
    ``moved`` the verified bytes per tier over all passes, ``times`` each rank's (consensus, rollback, replay):
    the record reports the slowest rank, since the job resumes when the last rank does.
    ``source_tiers`` counts ranks by where their base came from; ``rank_tiers[r]`` lists every tier
    rank r's units (base and diffs) came from, next to ``rank_nodes[r]``, the node rank r ran on.
    ``inventory_s`` (the slowest rank's) is the part of ``t_consensus_s`` spent listing the tiers and exchanging
    the inventory: it grows with what the tiers hold, the rest with the world size."""
    source_tiers = {TIER1: 0, TIER2: 0, TIER3: 0}
    for tier in sources.base.values():
        source_tiers[tier] += 1
    return {
        "event": "recovery",
        "failure_class": failure_class(sources.used(), tier1_present),
        "source_tiers": source_tiers,
        "rank_tiers": [sorted(sources.of(r)) for r in range(max(sources.tiers, default=-1) + 1)],
        "rank_nodes": list(rank_nodes) if rank_nodes is not None else None,
        "version": consensus.version,
        "end": consensus.end,
        "t_consensus_s": max(t[0] for t in times),
        "t_inventory_s": inventory_s,
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


def say_recovered(record: dict, rank: int) -> None:
    """The restore's console line (global rank 0), said by the caller once the record holds the launch's failure
    class: the tiers alone cannot tell a continuation after a clean exit ("none") from a software failure."""
    if rank != 0:
        return
    cls = record["failure_class"]
    checkfree = record.get("checkfree")
    log.info("recovered v%d -> E=%d (%s) from %s; %d fallbacks, %d stale units removed%s%s", record["version"],
             record["end"], "no failure: the last launch ended cleanly" if cls == "none" else cls,
             record["source_tiers"], len(record["fallbacks"]), record["stale_units_removed"],
             f"; resharded {record['resharded']}" if record.get("resharded") else "",
             f"; CheckFree rebuilt stage(s) {checkfree['stages']} (NOT exact)" if checkfree else "")
