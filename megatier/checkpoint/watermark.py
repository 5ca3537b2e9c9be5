"""The watermark sync: at each batch end every rank tells every other its tiers' recovery points, whether it
holds every tier (Tier-3's lease) and the newest committed base it knows; the manager takes the watermark
(the coordinator's newest committed base, monotonic) and the per-class recovery points from it.

The gather is started and not waited for: a rank that reaches the batch end first would otherwise hold its
loop until the slowest rank arrives (tens of milliseconds on a loaded box). It completes while the ranks
train and is read at the next batch end (or at once when it is already done, e.g. in a world of one), so the
watermark and the ``rpo_*`` metrics are at most one batch old. At most one gather is left running.
"""
from __future__ import annotations

from typing import Optional

from megatier.checkpoint.comm import CheckpointComm, PendingInts
from megatier.checkpoint.tiers.base import TIER1, TIER2, TIER3, TIER_ORDER

NONE = -1  # "no point yet" in the integer all-gather


def _worst(per_rank: list[int], floor: int) -> Optional[int]:
    """A failure class's recovery point is its worst rank's; any rank may fall back to ``floor`` (Tier-3)."""
    best = [max(p, floor) for p in per_rank]
    return None if NONE in best else min(best)


def recovery_points(columns: dict[str, list[int]], step: int) -> dict:
    """Per-class recovery points and tier lags from each tier's per-rank points (``NONE``: none).

    ``columns[label][r]`` is rank r's point on tier ``label`` (Tier-3's is rank 0's, the coordinator's).
    A software failure recovers from Tier-1; a node failure serves the lost node's ranks from Tier-2 and
    the rest from Tier-1, so every rank must assume the worse of the two; a rack failure from Tier-3.
    A class whose tier is absent falls back to the rack point.
    """
    t3 = columns[TIER3][0] if TIER3 in columns else NONE
    rack = t3 if t3 != NONE else None
    software = _worst(columns[TIER1], t3) if TIER1 in columns else rack
    node = rack
    if TIER2 in columns:
        node = _worst([min(a, b) for a, b in zip(columns[TIER1], columns[TIER2])], t3)
    t2_lag = None
    if TIER2 in columns and min(columns[TIER2]) != NONE:
        t2_lag = step - min(columns[TIER2])
    return {"rpo_software": software, "rpo_node": node, "rpo_rack": rack, "t2_lag_steps": t2_lag,
            "t3_lag_steps": (step - rack) if rack is not None else None}


class WatermarkSync:
    """The started gathers of one rank, in order; ``points`` and ``committed`` are those of the newest applied."""

    def __init__(self, comm: CheckpointComm, tiers: list):
        self.comm, self.tiers = comm, tiers
        self.points: dict = {}
        self.committed: Optional[int] = None  # the coordinator's newest committed base, as last gathered
        self._pending: list[tuple[int, list, PendingInts]] = []

    def start(self, step: int) -> None:
        """Start the gather of this batch end (after step ``step``)."""
        tiers = [t for t in self.tiers if t.saves]  # a read-only tier has no recovery point of this run
        durable = max((b for t in tiers if (b := t.durable_base()) is not None), default=None)
        points = {t.label: t.point() for t in tiers}  # a column per label: a rank with no ring holder lacks Tier-2
        mine = [NONE if points.get(label) is None else points[label] for label in TIER_ORDER]
        holds = int(all(t.holds_job() for t in tiers))
        pending = self.comm.gather_ints_async(mine + [holds, durable if durable is not None else NONE],
                                              what=f"the checkpoint watermark sync after step {step}")
        self._pending.append((step, tiers, pending))

    def absorb(self, block: bool) -> bool:
        """Apply the started gathers in order: the completed ones, any but the newest, and with ``block`` all;
        whether any was applied."""
        applied = False
        while self._pending:
            step, tiers, pending = self._pending[0]
            if not (block or len(self._pending) > 1 or pending.done()):
                break
            rows = pending.wait()
            self._pending.pop(0)
            self._apply(step, tiers, rows)
            applied = True
        return applied

    def drop(self) -> None:
        """The world broke (in-process recovery): the gathers in flight go with their process group."""
        self._pending = []

    def _apply(self, step: int, tiers: list, rows: list[list[int]]) -> None:
        self.points = recovery_points({t.label: [row[TIER_ORDER.index(t.label)] for row in rows] for t in tiers},
                                      step)
        if rows[0][-2] == 1:  # global rank 0 holds every tier (Tier-3's lease): writes may go out
            for tier in tiers:
                tier.allow_writes()
        self.committed = None if rows[0][-1] == NONE else rows[0][-1]
