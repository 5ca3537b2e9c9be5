"""Reclamation policy: which units each tier may delete (pure functions; :mod:`.executor` deletes them).

The watermark W is the newest base committed on Tier-3 that every rank has
learned of (the caller computes it and keeps it monotonic). The recovery point
at any time is some committed base V >= W plus a diff chain after it, so:

- Tier-1/Tier-2 (:func:`local_reclaim_set`): delete bases older than W and diff
  batches (and step units) ending at or before W. Base W, newer bases and every diff batch that
  reaches past W stay. Node memory does not wait for Tier-3 forever: it also
  reclaims below its own ``keep_bases``-th newest base (:func:`retention_floor`),
  so an outage of Tier-3 never grows it without bound, and the software and
  node recovery points (the newest base and its chain) are always kept.
- Tier-3 (:func:`remote_reclaim_set`): keep every base at or above W and the
  newest ``keep_bases`` committed bases at or below W; keep diff batches that
  end after the committed base preceding W (one more base interval, so a
  replacement rank can rebuild from Tier-3 alone even from that older base).
  Uncommitted units below those bounds are leftovers of crashed attempts.

With ``checkpoint.remote.base_every`` = n (:mod:`..policy.cadence`) Tier-3 gets every n-th base and every diff
batch, node memory every base. The sets above need no change, as they are stated in committed bases, not
intervals: W moves in steps of n intervals; Tier-3 keeps every batch after the committed base before W
(n intervals back), so the chain from W runs through the bases it skipped to the newest committed batch (the
rack point); node memory reclaims to max(W, its own ``keep_bases``-th newest base): however far W lags,
it holds at most ``keep_bases`` bases, and the floor never passes its newest base.

After a restore to E (:func:`beyond_end`): units ending after E are left over
from the failed run and would mix with the resumed one; every tier drops them
(Tier-3 keeps committed ones and says so).

The functions are pure (listing in, deletion set out) so the invariants can
be tested on their own.
"""
from __future__ import annotations

from typing import Iterable, Mapping, Optional

from megatier.checkpoint.format.units import BASE, PayloadId


def local_reclaim_set(held: Iterable[PayloadId], watermark: Optional[int]) -> set[PayloadId]:
    """Units of a Tier-1/Tier-2 area that watermark ``watermark`` makes obsolete (none without one)."""
    if watermark is None:
        return set()
    return {p for p in held
            if (p.kind == BASE and p.version < watermark) or (p.replays and p.last <= watermark)}


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


def retention_floor(held: Iterable[PayloadId], keep_bases: int) -> Optional[int]:
    """The version below which node memory may drop units whatever Tier-3 has: its ``keep_bases``-th newest
    base (None while it holds fewer). Reclaiming below it keeps the newest bases and every chain from them."""
    bases = sorted({p.version for p in held if p.kind == BASE})
    return bases[-keep_bases] if len(bases) >= keep_bases else None


def node_memory_floor(watermark: Optional[int], floor: Optional[int]) -> Optional[int]:
    """What node memory reclaims against: the watermark, or the retention floor when that is newer."""
    candidates = [v for v in (watermark, floor) if v is not None]
    return max(candidates) if candidates else None


def beyond_end(held: Iterable[PayloadId], end: int) -> set[PayloadId]:
    """Units that end after the recovery point ``end``: the failed run's, never part of the resumed one."""
    return {p for p in held if p.last > end}
