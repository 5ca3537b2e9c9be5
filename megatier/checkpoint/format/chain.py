"""The diff-chain walk: which steps a base reaches through contiguous diff batches and step units.

A rank's state at step e is rebuilt from a base at version v and units (diff
batches, step units) whose step ranges tile v+1..e without a gap; a unit's
records are replayed in order, so a chain may stop inside a unit (replaying
its first records only) and the next unit may start inside one. That matters
after a crash: one rank's open batch may have landed while another rank has
only the step units of the same steps. Everything that needs a recovery point
(Tier-1's and Tier-3's points on the save path, the consensus at restore)
walks chains with these functions, so they all agree.
"""
from __future__ import annotations

from typing import Iterable, Optional

from megatier.checkpoint.format.units import PayloadId


def reachable(version: int, batches: Iterable[PayloadId]) -> dict[int, Optional[PayloadId]]:
    """Every step reachable from a base at ``version`` -> the unit that reaches it (None: the base).

    Units are visited by first step, so every step before a unit's first is settled when the unit is."""
    reach: dict[int, Optional[PayloadId]] = {version: None}
    for pid in sorted(batches, key=lambda p: (p.first, p.last)):
        if pid.first > version and pid.first - 1 in reach:
            for step in range(pid.first, pid.last + 1):
                reach.setdefault(step, pid)
    return reach


def chain_to(reach: dict[int, Optional[PayloadId]], version: int, end: int) -> list[PayloadId]:
    """The units that rebuild step ``end`` from base ``version``: the base, then its units in order (each
    replayed up to the step before the next one's first, the last up to ``end``: :func:`replay_ends`)."""
    batches, e = [], end
    while e != version:
        pid = reach[e]
        batches.append(pid)
        e = pid.first - 1
    return [PayloadId.base(version)] + batches[::-1]


def replay_ends(chain: list[PayloadId], end: int) -> list[int]:
    """For each unit of a :func:`chain_to` chain, the last step of it to apply (a base: its version)."""
    return [chain[0].version] + [nxt.first - 1 for nxt in chain[2:]] + ([end] if len(chain) > 1 else [])


def chain_end(bases: Iterable[int], batches: Iterable[PayloadId]) -> Optional[int]:
    """Newest step reachable from any of ``bases``; None without a base."""
    batches = list(batches)
    return max((max(reachable(b, batches)) for b in bases), default=None)
