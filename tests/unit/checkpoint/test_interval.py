"""base_interval=auto: the closed-form optimum against a brute-force search on a simulated failure process."""
from __future__ import annotations

import math

import numpy as np
import pytest

from megatier.checkpoint.policy.interval import (
    IntervalCosts,
    choose_interval,
    expected_goodput,
    failures_per_step,
    optimal_interval,
)

pytestmark = pytest.mark.timeout(60)
COSTS = IntervalCosts(step_s=1.0, base_s=5.0, replay_s=0.05, failure_s=60.0)
MTBF_H = 2.0


def simulated_goodput(n: int, c: IntervalCosts, mtbf_s: float, gaps: np.ndarray) -> float:
    """Goodput of a job that takes a base every ``n`` steps, failing after each of ``gaps`` seconds of work.

    Between failures the job runs cycles of n steps and one base (n T + C seconds). A failure loses the step
    or base in flight, keeps every finished step (a diff every step), and costs F plus the replay of the steps
    since the last finished base; the job then goes on from there. No closed form is used: the counts come
    from the gaps themselves.
    """
    cycle = n * c.step_s + c.base_s
    full = np.floor(gaps / cycle)
    rest = gaps - full * cycle
    tail = np.minimum(np.floor(rest / c.step_s), n)  # finished steps after the last finished base
    steps = full * n + tail
    total = gaps.sum() + len(gaps) * c.failure_s + c.replay_s * tail.sum()
    return float(c.step_s * steps.sum() / total)


def _gaps(mtbf_s: float, count: int = 200_000) -> np.ndarray:
    return np.random.default_rng(7).exponential(mtbf_s, count)


def test_the_formula_finds_the_interval_a_brute_force_search_finds():
    mtbf_s = MTBF_H * 3600
    p = failures_per_step(COSTS.step_s, MTBF_H)
    gaps = _gaps(mtbf_s)  # the same failures for every interval tried
    grid = list(range(50, 5001, 50))
    simulated = {n: simulated_goodput(n, COSTS, mtbf_s, gaps) for n in grid}
    best = max(simulated, key=simulated.get)
    choice = choose_interval(COSTS, p, batch=50)
    assert optimal_interval(COSTS, p) == pytest.approx(1200.0)
    assert abs(choice.interval - best) <= 0.15 * best, (choice.interval, best)
    # The choice is as good as the search's best within 0.01 points; an interval 4x off costs ~1 point.
    assert simulated[choice.interval] >= simulated[best] - 1e-4
    assert simulated[best] - simulated[300] > 0.005 and simulated[best] - simulated[4800] > 0.005
    # The model's expected goodput matches the simulation's.
    assert expected_goodput(choice.interval, COSTS, p) == pytest.approx(simulated[choice.interval], abs=2e-3)


def test_the_per_step_diff_moves_the_optimum_far_beyond_the_classic_one():
    """The classic model loses half an interval of steps; MegaTier replays half an interval of diffs."""
    p = failures_per_step(COSTS.step_s, MTBF_H)
    classic = math.sqrt(2 * COSTS.base_s / (p * COSTS.step_s))
    assert optimal_interval(COSTS, p) == pytest.approx(classic * math.sqrt(COSTS.step_s / COSTS.replay_s))


def test_bounds_and_rounding():
    p = failures_per_step(COSTS.step_s, MTBF_H)
    assert choose_interval(COSTS, p, batch=50).interval % 50 == 0
    capped = choose_interval(COSTS, p, batch=50, max_interval=400)
    assert capped.interval == 400 and capped.bound == "capped by node memory"
    slow_upload = IntervalCosts(step_s=1.0, base_s=5.0, replay_s=0.05, upload_s=2000.0)
    raised = choose_interval(slow_upload, p, batch=50)
    assert raised.interval == 2000 and "upload" in raised.bound
    assert "expected goodput" in capped.describe(COSTS, MTBF_H)


def test_an_infinite_optimum_needs_a_cap():
    c = IntervalCosts(step_s=1.0, base_s=5.0, replay_s=0.0)
    with pytest.raises(ValueError, match="finite optimum"):
        choose_interval(c, 1e-4, batch=5)
    assert choose_interval(c, 1e-4, batch=5, max_interval=500).interval == 500
