"""Watermark-driven reclamation: which units each tier may delete, then deleting them.

The watermark W is the newest base committed on Tier-3 that every rank has
learned of (the caller computes it and keeps it monotonic). The recovery point
at any time is some committed base V >= W plus a diff chain after it, so:

- Tier-1/Tier-2 (:func:`local_reclaim_set`): delete bases older than W and diff
  batches ending at or before W. Base W, newer bases and every diff batch that
  reaches past W stay.
- Tier-3 (:func:`remote_reclaim_set`): keep every base at or above W and the
  newest ``keep_bases`` committed bases at or below W; keep diff batches that
  end after the committed base preceding W (one more base interval, so a
  replacement rank can rebuild from Tier-3 alone even from that older base).
  Uncommitted units below those bounds are leftovers of crashed attempts.

The set functions are pure (listing in, deletion set out) so the invariants can
be tested on their own; the ``reclaim_*`` functions list, compute and delete.
Deletion order makes a unit stop being a source before its bytes go: Tier-1
stamp before data; Tier-3 ``_COMMITTED`` before markers before payloads.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional

from megatier.checkpoint.commit.records import COMMITTED, list_units
from megatier.checkpoint.tiers.node_memory import LocalTier
from megatier.checkpoint.format.units import BASE, DIFF, PayloadId
from megatier.checkpoint.tiers.store import ObjectStore


def local_reclaim_set(held: Iterable[PayloadId], watermark: Optional[int]) -> set[PayloadId]:
    """Units of a Tier-1/Tier-2 area that watermark ``watermark`` makes obsolete (none without one)."""
    if watermark is None:
        return set()
    return {p for p in held
            if (p.kind == BASE and p.version < watermark) or (p.kind == DIFF and p.last <= watermark)}


def remote_reclaim_set(units: Mapping[PayloadId, bool], watermark: Optional[int],
                       keep_bases: int) -> set[PayloadId]:
    """Tier-3 units (``pid -> committed``) to delete; ValueError if W is not a committed base."""
    if keep_bases < 1:
        raise ValueError(f"keep_bases={keep_bases} must be >= 1; the recovery point needs its base")
    if watermark is None:
        return set()
    committed_bases = sorted(p.version for p, committed in units.items() if committed and p.kind == BASE)
    if watermark not in committed_bases:
        raise ValueError(f"watermark {watermark} is not a committed base on Tier-3 (committed bases: "
                         f"{committed_bases}); refusing to reclaim against it")
    kept = set([b for b in committed_bases if b <= watermark][-keep_bases:])
    older = [b for b in committed_bases if b < watermark]
    diff_floor = older[-1] if older else None
    doomed = set()
    for p in units:
        if p.kind == BASE:
            if p.version < watermark and p.version not in kept:
                doomed.add(p)
        elif diff_floor is not None and p.last <= diff_floor:
            doomed.add(p)
    return doomed


def reclaim_local(tier: LocalTier, owner_rank: int, watermark: Optional[int], *,
                  replica: bool = False) -> list[PayloadId]:
    """Delete obsolete units of one Tier-1 (own) or Tier-2 (replica) area; returns them, oldest first."""
    held = [e.pid for e in tier.entries(replica=replica, owner_rank=owner_rank)]
    doomed = sorted(local_reclaim_set(held, watermark), key=lambda p: (p.last, p.kind))
    for pid in doomed:
        tier.delete(owner_rank, pid, replica=replica)
    return doomed


def _deletion_order(key: str) -> tuple[int, str]:
    name = key.rpartition("/")[2]
    return (0 if name == COMMITTED else 1 if name.endswith(".done.json") else 2), key


def reclaim_remote(store: ObjectStore, watermark: Optional[int], keep_bases: int) -> list[PayloadId]:
    """Delete obsolete Tier-3 units; run on the coordinator, in the thread that commits."""
    units = list_units(store)
    doomed = sorted(remote_reclaim_set({p: u.committed for p, u in units.items()}, watermark, keep_bases),
                    key=lambda p: (p.last, p.kind))
    for pid in doomed:
        for key in sorted(units[pid].objects, key=_deletion_order):
            store.delete(key)
    return doomed
