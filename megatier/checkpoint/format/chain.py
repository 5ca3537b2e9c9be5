"""The diff-chain walk: which steps a base reaches through contiguous diff batches.

A rank's state at step e is rebuilt from a base at version v and diff batches
whose step ranges tile v+1..e without a gap. Everything that needs a recovery
point (Tier-1's and Tier-3's points on the save path, the consensus at
restore) walks chains with these functions, so they all agree.
"""
from __future__ import annotations

from typing import Iterable, Optional

from megatier.checkpoint.format.units import PayloadId


def reachable(version: int, batches: Iterable[PayloadId]) -> dict[int, Optional[PayloadId]]:
    """Every step reachable from a base at ``version`` -> the diff batch that reaches it (None: the base)."""
    reach: dict[int, Optional[PayloadId]] = {version: None}
    for pid in sorted(batches, key=lambda p: (p.first, p.last)):
        if pid.first > version and pid.first - 1 in reach and pid.last not in reach:
            reach[pid.last] = pid
    return reach


def chain_to(reach: dict[int, Optional[PayloadId]], version: int, end: int) -> list[PayloadId]:
    """The units that rebuild step ``end`` from base ``version``: the base, then its batches in order."""
    batches, e = [], end
    while e != version:
        pid = reach[e]
        batches.append(pid)
        e = pid.first - 1
    return [PayloadId.base(version)] + batches[::-1]


def chain_end(bases: Iterable[int], batches: Iterable[PayloadId]) -> Optional[int]:
    """Newest step reachable from any of ``bases``; None without a base."""
    batches = list(batches)
    return max((max(reachable(b, batches)) for b in bases), default=None)
