"""MEGATIER_CRASH_AT parsing and arming (the kill itself is exercised by the distributed drills)."""
import os
import signal

import pytest

from megatier.faults import ENV, CrashPoint, FaultInjector


def test_disarmed_by_default():
    f = FaultInjector.from_env(0, {})
    assert not f.armed
    f.hit("t1.mid_write", 10**6)  # nothing happens


@pytest.mark.parametrize("spec,point,step,rank", [("t1.mid_write:5", "t1.mid_write", 5, None),
                                                   ("replay.mid_batch:12:3", "replay.mid_batch", 12, 3)])
def test_parse(spec, point, step, rank):
    f = FaultInjector.from_env(3, {ENV: spec})
    (a,) = f.armed_points
    assert (a.point, a.step, a.only_rank, f.armed) == (point, step, rank, True)


def test_several_points_the_first_reached_fires(monkeypatch):
    kills = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: kills.append(sig))
    f = FaultInjector.from_env(0, {ENV: "replay.mid_batch:0, train.step_end:40:0, gc.mid_delete:3:1"})
    assert [str(a.point) for a in f.armed_points] == ["replay.mid_batch", "train.step_end"]  # rank 1's dropped
    f.hit("train.step_end", 39)
    assert kills == []
    f.hit("train.step_end", 40)
    assert kills == [signal.SIGKILL]


@pytest.mark.parametrize("spec", ["nope:3", "t1.mid_write", "t1.mid_write:x", "t1.mid_write:1:2:3"])
def test_malformed_is_an_error_naming_the_points(spec):
    with pytest.raises(ValueError, match="t3.before_commit"):
        FaultInjector.from_env(0, {ENV: spec})


def test_rank_filter_disarms_other_ranks():
    assert not FaultInjector.from_env(1, {ENV: "gc.mid_delete:4:0"}).armed


def test_fires_at_or_after_the_step_only(monkeypatch):
    kills = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: kills.append(sig))
    f = FaultInjector.from_env(0, {ENV: "t3.before_marker:10"})
    f.hit("t3.before_marker", 9)
    f.hit("t2.mid_chunk", 10)
    assert kills == []
    f("t3.before_marker", 15)
    assert kills == [signal.SIGKILL]


def test_issue_points_are_all_named():
    for p in ("t1.mid_write", "t2.mid_chunk", "t3.before_marker", "t3.before_commit",
              "t3.after_commit_before_watermark", "gc.mid_delete", "replay.mid_batch"):
        assert p in {c.value for c in CrashPoint}
