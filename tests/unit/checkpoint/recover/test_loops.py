"""The restart-loop guard: a job that keeps failing right after its restores takes an older point, then stops.

The decision is tested on histories alone; the whole path (history kept in the tiers, the fallback's consensus,
the cleanup after it, the clean mark at close) on in-memory tiers with a real optimizer shard, where a launch
that "fails" is a manager dropped without close().
"""
from __future__ import annotations

import pytest
import torch

from megatier.checkpoint.format.payload import Stamp
from megatier.checkpoint.format.units import BASE, PayloadId
from megatier.checkpoint.manager import CheckpointManager
from megatier.checkpoint.recover.loops import (
    Fallback,
    RestoreLoop,
    appended,
    closed,
    newest,
    plan,
    trailing_loops,
    with_failure,
)
from megatier.checkpoint.tiers.base import JOB as JOB_SCOPE
from megatier.checkpoint.tiers.base import TIER1, TIER3, Copy
from megatier.parallel.layout import Layout
from tests.unit.checkpoint.memory import MemoryTier, context, snapshot, step, tiny_shard

pytestmark = pytest.mark.timeout(120)
WINDOW, LIMIT = 10, 2


def _history(*restores: tuple[int, int, int, int]) -> list[dict]:
    """(version, end, level, reached) per restore, in order."""
    history: list[dict] = []
    for version, end, level, reached in restores:
        history = with_failure(appended(history, version=version, end=end, level=level), reached)
    return history


def test_a_job_that_keeps_failing_at_the_same_step_falls_back_level_by_level():
    assert plan([], WINDOW, LIMIT) == Fallback()
    once = _history((20, 25, 0, 25))
    assert plan(once, WINDOW, LIMIT) == Fallback()  # one loop: the newest point again
    twice = _history((20, 25, 0, 25), (25, 25, 0, 25))
    assert plan(twice, WINDOW, LIMIT) == Fallback(1, below=25)  # below the looping point: base 20 on its own
    fallback = _history((20, 25, 0, 25), (25, 25, 0, 25), (20, 20, 1, 25))
    assert fallback[-1]["mark"] == 25  # the fallback's launch must get past the failure, not past 20
    assert plan(fallback, WINDOW, LIMIT) == Fallback(1, below=25)
    both = _history((20, 25, 0, 25), (25, 25, 0, 25), (20, 20, 1, 25), (20, 20, 1, 25))
    assert plan(both, WINDOW, LIMIT) == Fallback(2, below=20, tier3_only=True)
    every = _history((20, 25, 0, 25), (25, 25, 0, 25), (20, 20, 1, 25), (20, 20, 1, 25), (10, 10, 2, 25),
                     (10, 10, 2, 25))
    stop = r"restore loop: .*\(v20->E=25 \(failed after step 25\).*v10->E=10.*step 26 itself"
    with pytest.raises(RestoreLoop, match=stop):
        plan(every, WINDOW, LIMIT)


def test_progress_a_clean_end_or_a_late_failure_is_not_a_loop():
    moving = _history((20, 25, 0, 29), (29, 29, 0, 33), (33, 33, 0, 37))  # fails every 4 steps, moves on
    assert trailing_loops(moving, WINDOW) == moving[-1:] and plan(moving, WINDOW, LIMIT) == Fallback()
    past = _history((20, 25, 0, 25), (25, 25, 0, 25), (20, 20, 1, 31))  # the fallback got past step 26
    assert trailing_loops(past, WINDOW) == [] and plan(past, WINDOW, LIMIT) == Fallback()
    late = _history((20, 25, 0, 25), (25, 25, 0, 36))  # got 11 steps past its point
    assert trailing_loops(late, WINDOW) == [] and plan(late, WINDOW, LIMIT) == Fallback()
    clean = closed(_history((20, 25, 0, None), (25, 25, 0, None)))  # the last launch ended without a failure
    assert with_failure(clean, 27)[-1]["reached"] is None and plan(with_failure(clean, 27), WINDOW, LIMIT) == \
        Fallback()
    assert plan(_history((20, 25, 0, 25), (25, 25, 0, 25)), WINDOW, 0) == Fallback()  # the guard off


def test_the_newest_history_is_the_one_with_the_most_restores():
    old = _history((20, 25, 0, 25))
    new = _history((20, 25, 0, 25), (25, 25, 0, 25))
    assert newest([old, new, []]) == new and newest([]) == []
    assert newest([new, closed(new)]) == closed(new)


def test_a_fallback_offers_only_older_bases_and_at_level_two_only_tier3s():
    def copy(pid: PayloadId, tier: str) -> Copy:
        return Copy(Stamp(pid, 0, "0", "j", Layout(1, 1, 1, 0, 0, 0)), tier, None if tier == TIER3 else "n")
    B = PayloadId.base
    copies = [copy(B(10), TIER1), copy(B(20), TIER1), copy(B(10), TIER3), copy(B(25), TIER3),
              copy(PayloadId.step(21), TIER1)]
    assert Fallback().usable(copies) == copies
    assert [(c.pid.version, c.tier) for c in Fallback(1, 25).usable(copies)] == [(10, TIER1), (20, TIER1),
                                                                                 (10, TIER3)]
    assert [(c.pid.version, c.tier) for c in Fallback(2, 20, True).usable(copies)] == [(10, TIER3)]
    assert all(c.pid.kind == BASE for c in Fallback(1, 30).usable(copies))


# ---- the whole path, on in-memory tiers ---------------------------------------------------------------------


def _tiers() -> list[MemoryTier]:
    return [MemoryTier(TIER1, takes_steps=True), MemoryTier(TIER3, scope=JOB_SCOPE)]


def _launch(tiers, *, train_to: int = 0, close: bool = False):
    """One launch: restore, train to ``train_to``, then close cleanly or fail (the manager dropped)."""
    opt, shard = tiny_shard()
    manager = CheckpointManager(context(tiers), shard, inline=True)
    start, record = manager.restore()
    for s in range(start + 1, train_to + 1):
        step(opt, s)
        manager.after_step(s)
    if close:
        manager.close()
    return start, record, opt


def _same(opt, snap: dict) -> bool:
    return all(torch.equal(getattr(opt, n), snap[n]) for n in ("master", "exp_avg", "exp_avg_sq"))


def test_a_recurring_failure_after_restore_falls_back_to_the_previous_base_and_the_run_recovers():
    reference = {}
    opt, _ = tiny_shard()
    for s in range(1, 31):
        step(opt, s)
        reference[s] = snapshot(opt)
    tiers = _tiers()
    _launch(tiers, train_to=25)  # fails in step 26
    for _ in range(LIMIT):  # restored at 25 each time, fails in step 26 again
        start, record, _ = _launch(tiers)
        assert start == 25 and record["fallback"] is None
    start, record, opt = _launch(tiers, train_to=30, close=True)  # the guard takes base 20 on its own
    assert start == 20 and record["version"] == 20 and record["fallback"].startswith("the previous base")
    assert _same(opt, reference[30])  # the steps after 20 trained again: the state of a run that never failed
    start, record, _ = _launch(tiers)  # the fallback's launch ended cleanly: the newest point again
    assert start == 30 and record["fallback"] is None


def test_a_job_whose_every_point_loops_stops_with_one_line(caplog):
    tiers = _tiers()
    _launch(tiers, train_to=25)
    starts = []
    with pytest.raises(RestoreLoop) as stopped:
        for _ in range(10):
            starts.append(_launch(tiers)[0])
    # Twice the newest point, twice the previous base, twice Tier-3's newest base below it, then the stop.
    assert starts == [25, 25, 20, 20, 10, 10]
    line = str(stopped.value)
    assert "\n" not in line and "reliability.loop_window=10" in line and "v10->E=10" in line
    assert "failed after step 25" in line and "reliability.loop_limit=0" in line


def test_a_rack_failure_is_never_taken_for_a_loop():
    """Node memory gone (progress keys and units with it): how far the last launch got is unknown, and Tier-3's
    older units must not make it look like a launch that failed at once."""
    tiers = _tiers()
    _launch(tiers, train_to=25)
    _launch(tiers, train_to=27)  # trained on, then every node was lost
    tiers[0].units.clear()
    tiers[0].restores = []
    start, record, _ = _launch(tiers)
    assert record["fallback"] is None and tiers[1].restores[-2]["reached"] is None
    assert _launch(tiers)[1]["fallback"] is None  # one loop since the rack (before it: none that counts)
    assert _launch(tiers)[1]["fallback"] is not None  # two: the guard works on from there
