"""The base interval that maximises goodput (``checkpoint.base_interval=auto``): the model and its optimum.

GoCkpt (arXiv:2511.07035, section 3.1) takes the classic view: a failure loses the
work since the last checkpoint, on average half an interval of N steps, so the
overhead per step is T_ckpt / N + p N T_step / 2 and N* = sqrt(2 T_ckpt /
(p T_step^2)) in its units. MegaTier keeps a diff every step: a failure loses
at most the step in flight whatever N is. What grows with N is the diff chain
that recovery replays after loading the base: on average N / 2 diff steps.
Per training step, with

    T   the step time (s),           C   what one base costs the job (s),
    r   replay time per diff step,   p   failures per step = T / MTBF,
    F   the fixed cost of a failure (restart, restore without replay, the step in flight),

the expected time per step is T + C / N + p (F + r N / 2), minimal at

    N* = sqrt(2 C / (p r))

(dE/dN = -C / N^2 + p r / 2). Because r is far below T (replaying a step is a
fused elementwise kernel; computing it is a forward and backward), N* is
larger than GoCkpt's by about sqrt(T / r): bases can be rare. Two bounds cap
it: a base must finish uploading to Tier-3 before the next one (N >= U / T,
U the upload time), and node memory holds ``local.keep_bases`` bases plus the
diffs between them, so N <= ``max_interval`` when the caller gives one. The
result is rounded to a multiple of ``diff.batch`` (the unit of Tier-3 upload
and replay) and to at least ``capture_steps``. The expected goodput at N is
T / (T + C / N + p (F + r N / 2)). docs/goodput.md walks through it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megatier.config.schema import CheckpointConfig


@dataclass(frozen=True)
class IntervalCosts:
    """Measured costs, in seconds."""

    step_s: float  # T: a training step
    base_s: float  # C: one base's cost to the job (the loop's stall for it plus helper CPU time)
    replay_s: float  # r: replaying one diff step at recovery
    failure_s: float = 0.0  # F: restart, restore without replay, the step in flight
    upload_s: float = 0.0  # U: one base's Tier-3 upload


def failures_per_step(step_s: float, mtbf_hours: float) -> float:
    """p: the chance a given step is hit by a failure, for a cluster MTBF (cluster = node MTBF / nodes)."""
    return step_s / (mtbf_hours * 3600.0)


def expected_step_s(n: float, c: IntervalCosts, p: float) -> float:
    """Expected wall time per productive step at base interval ``n``."""
    return c.step_s + c.base_s / n + p * (c.failure_s + c.replay_s * n / 2.0)


def expected_goodput(n: float, c: IntervalCosts, p: float) -> float:
    return c.step_s / expected_step_s(n, c, p)


def optimal_interval(c: IntervalCosts, p: float) -> float:
    """The unconstrained optimum N* = sqrt(2 C / (p r)) (infinite when nothing fails or replay is free)."""
    if p <= 0 or c.replay_s <= 0:
        return math.inf
    return math.sqrt(2.0 * c.base_s / (p * c.replay_s))


@dataclass(frozen=True)
class IntervalChoice:
    interval: int
    optimum: float  # N* before bounds and rounding
    goodput: float  # expected at ``interval``
    bound: Optional[str]  # what moved it off N*, if anything

    def describe(self, c: IntervalCosts, mtbf_hours: float) -> str:
        why = f" ({self.bound})" if self.bound else ""
        return (f"base_interval=auto: {self.interval} steps{why}; N* = {self.optimum:.0f} from step "
                f"{c.step_s * 1e3:.0f} ms, base {c.base_s * 1e3:.1f} ms, replay {c.replay_s * 1e3:.2f} ms/step, "
                f"cluster MTBF {mtbf_hours:g} h; expected goodput {100 * self.goodput:.3f}%"
                + (" (the restart after a failure not counted: the interval does not change it)"
                   if c.failure_s == 0 else ""))


def choose_interval(c: IntervalCosts, p: float, *, batch: int, min_interval: int = 1,
                    max_interval: Optional[int] = None) -> IntervalChoice:
    """N* bounded by the upload time, ``min_interval`` and ``max_interval``, as a multiple of ``batch``: of the
    two neighbouring multiples, the one with the lower expected step time."""
    optimum = optimal_interval(c, p)
    target, bound = optimum, None
    lowest = max(min_interval, math.ceil(c.upload_s / c.step_s) if c.upload_s > 0 else 1, batch)
    if target < lowest:
        target, bound = lowest, "raised to let a base upload before the next one"
    if max_interval is not None and target > max_interval:
        target, bound = max_interval, "capped by node memory"
    if math.isinf(target):
        raise ValueError("base_interval=auto needs a finite optimum: give an MTBF and a measurable replay time, "
                         "or a max_interval")
    down = max(batch, math.floor(target / batch) * batch)
    up = math.ceil(target / batch) * batch
    choices = [n for n in (down, up) if n >= lowest and (max_interval is None or n <= max_interval)] or [down]
    best = min(choices, key=lambda n: expected_step_s(n, c, p))
    return IntervalChoice(best, optimum, expected_goodput(best, c, p), bound)


def auto_min_interval(cfg: CheckpointConfig) -> int:
    """The smallest interval ``base_interval=auto`` may choose: the warm-up plus a capture window, in whole diff
    batches (the first base's capture starts after the decision)."""
    batch = cfg.diff.batch
    return -(-(cfg.auto_warmup_steps + cfg.capture_steps) // batch) * batch
