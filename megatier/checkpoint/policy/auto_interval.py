"""``checkpoint.base_interval=auto``: measure the costs during a warm-up, then choose the interval once.

A launch with ``auto`` takes its anchor base as usual and no other base
during ``auto_warmup_steps`` steps. Meanwhile every rank measures (:class:`CostMeter`):

* T, the step: the median wall time between two ``after_step`` calls
  (the step and its checkpoint stall);
* C, a base: the loop's capture of the anchor base plus the save thread's
  time to encode and store it (on a CPU box the save thread takes cores from
  training, so its time counts in full);
* r, the replay of one diff step: ``adamw_replay`` timed on a copy of part of
  the shard, scaled to all of it;
* U, a base's Tier-3 upload, when the remote tier has uploaded one.

At the last warm-up step every rank gathers every rank's figures, and all
take the same decision from the worst rank's (:func:`decide`):
:func:`~megatier.checkpoint.policy.interval.choose_interval` with the cluster MTBF
(``mtbf_hours``, or ``node_mtbf_hours`` / nodes), at least the warm-up plus
``capture_steps`` (the first base's capture starts after the decision), at
most ``auto_max_interval``. Bases then fall at anchor + m * N for the rest of
the launch; the next launch decides again.
"""
from __future__ import annotations

import statistics
import time
from typing import Optional

import torch

from megatier import ops
from megatier.checkpoint.policy.interval import (
    IntervalChoice,
    IntervalCosts,
    auto_min_interval,
    choose_interval,
    failures_per_step,
)
from megatier.config import CheckpointConfig

REPLAY_SAMPLE = 1 << 20  # elements of the shard the replay is timed on
REPLAY_STEPS = 4


def provisional_interval(cfg: CheckpointConfig) -> int:
    """The smallest interval ``auto`` may choose (:func:`~megatier.checkpoint.policy.interval.auto_min_interval`);
    until the decision it stands in wherever a number is needed (Tier-2 pacing)."""
    return auto_min_interval(cfg)


def initial_interval(cfg: CheckpointConfig) -> int:
    """``base_interval``, or with ``auto`` the provisional one until the decision."""
    return provisional_interval(cfg) if cfg.base_interval == "auto" else cfg.base_interval


def cluster_mtbf_hours(cfg: CheckpointConfig, nodes: int) -> float:
    return cfg.mtbf_hours if cfg.mtbf_hours is not None else cfg.node_mtbf_hours / nodes


def replay_seconds_per_step(master: torch.Tensor, optim, decay_ranges: torch.Tensor) -> float:
    """Time of one diff step's replay over the whole shard, measured on a copy of up to REPLAY_SAMPLE of it."""
    n = min(master.numel(), REPLAY_SAMPLE)
    if n == 0:
        return 0.0
    state = [master[:n].float().clone() for _ in range(3)]
    state[2].abs_()  # exp_avg_sq must be non-negative
    grads = [torch.full((n,), 1e-3) for _ in range(REPLAY_STEPS)]
    ranges = torch.tensor([[0, n]], dtype=torch.int64) if decay_ranges.numel() else decay_ranges
    start = time.perf_counter()
    ops.adamw_replay(*state, grads, list(range(1, REPLAY_STEPS + 1)), [1e-4] * REPLAY_STEPS, optim.beta1,
                     optim.beta2, optim.eps, optim.weight_decay, ranges, skipped=[False] * REPLAY_STEPS)
    return (time.perf_counter() - start) / REPLAY_STEPS * master.numel() / n


class CostMeter:
    """This rank's measurements during the warm-up of ``auto``."""

    def __init__(self, cfg: CheckpointConfig, anchor: int):
        self.cfg = cfg
        self.decide_at = anchor + cfg.auto_warmup_steps
        self.anchor_capture_s = 0.0  # the loop's copy of the anchor base
        self._last: Optional[float] = None
        self._steps: list[float] = []

    def step_done(self) -> None:
        now = time.perf_counter()
        if self._last is not None:
            self._steps.append(now - self._last)
        self._last = now

    def figures(self, *, save_thread_base_s: float, upload_s: Optional[float], replay_s: float,
                node: str) -> dict:
        """What this rank contributes to the decision (gathered from every rank)."""
        step_s = statistics.median(self._steps) if self._steps else 0.0
        return {"step_s": step_s, "base_s": self.anchor_capture_s + save_thread_base_s,
                "replay_s": replay_s, "upload_s": upload_s or 0.0, "node": node}


def decide(cfg: CheckpointConfig, rows: list[dict]) -> tuple[IntervalChoice, IntervalCosts, float]:
    """The interval every rank takes, from every rank's figures (the worst of each); also the costs used and
    the cluster MTBF in hours."""
    costs = IntervalCosts(step_s=max(r["step_s"] for r in rows), base_s=max(r["base_s"] for r in rows),
                          replay_s=max(r["replay_s"] for r in rows), upload_s=max(r["upload_s"] for r in rows))
    mtbf = cluster_mtbf_hours(cfg, len({r["node"] for r in rows}))
    p = failures_per_step(costs.step_s, mtbf)
    choice = choose_interval(costs, p, batch=cfg.diff.batch, min_interval=provisional_interval(cfg),
                             max_interval=cfg.auto_max_interval)
    return choice, costs, mtbf
