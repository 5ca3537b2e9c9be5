"""The tiers' health, for the console and the metrics: which tier is degraded now (a line when its trouble
starts and one when it ends), and where the job's checkpoints stand at exit."""
from __future__ import annotations

import logging
from typing import Optional

from megatier.checkpoint.context import CheckpointContext
from megatier.checkpoint.tiers.base import TIER3

log = logging.getLogger(__name__)


class TierHealth:
    """One rank's view of its tiers' troubles, from one batch end to the next."""

    def __init__(self, ctx: CheckpointContext):
        self.ctx = ctx
        self._troubled: dict[str, str] = {}  # tier label -> its trouble at the last look

    def degraded(self) -> Optional[str]:
        """Tiers that cannot store what they are given now. One console line when a tier's trouble starts and one
        when it ends (Tier-3's on global rank 0 only: it is one store for every rank)."""
        problems = {t.label: p for t in self.ctx.tiers if (p := t.degraded()) is not None}
        for label in sorted(set(problems) | set(self._troubled)):
            if label == TIER3 and self.ctx.rank != 0:
                continue
            if label in problems and label not in self._troubled:
                log.warning("rank %d: checkpointing is degraded, training goes on: %s", self.ctx.rank,
                            problems[label])
            elif label not in problems:
                where = next(t.where() for t in self.ctx.tiers if t.label == label)
                log.warning("rank %d: %s is healthy again; what it missed is being stored", self.ctx.rank, where)
        self._troubled = problems
        return "; ".join(problems[k] for k in sorted(problems)) if problems else None


def final_status(ctx: CheckpointContext, saved: int) -> dict:
    """Where the run's checkpoints stand at exit, the job having saved through step ``saved``; the same on every
    rank (one gather). Says loudly when Tier-3 stayed behind."""
    tiers = {t.label: t for t in ctx.tiers}
    rack = tiers[TIER3].point() if TIER3 in tiers else None
    rows = ctx.comm.gather({"behind": sum(t.behind() for t in ctx.tiers), "rack": rack},
                           what="the final checkpoint status")
    status = {"checkpoint_saved_step": saved, "checkpoint_durable_step": rows[0]["rack"],
              "checkpoint_units_behind": sum(r["behind"] for r in rows), "checkpoint_behind": False}
    if TIER3 in tiers:
        durable = status["checkpoint_durable_step"]
        status["checkpoint_behind"] = durable is None or durable < saved or status["checkpoint_units_behind"] > 0
    if status["checkpoint_behind"] and ctx.rank == 0:
        memory = [t.where() for t in ctx.tiers if t.label != TIER3]
        log.warning("%s is %d units behind at exit: the last durable version is %s (a rack failure resumes "
                    "there), the job saved through step %d; the newer units remain only in %s, from which a "
                    "relaunch recovers and then uploads a fresh base", tiers[TIER3].where(),
                    status["checkpoint_units_behind"], f"v{durable}" if durable is not None else "none",
                    saved, ", ".join(memory) or "no other tier")
    return status
