"""Time-limited jobs through megatier-train: train.exit_interval and train.exit_duration_in_mins stop after a
step with the checkpoints durable and exit 0, and the relaunch goes on to the same state as a run never stopped."""
from __future__ import annotations

import time

import pytest

from megatier.training.interrupt import StopRequest
from megatier.training.time_limit import TimeLimit, process_start
from tests.unit.training.test_entry import _common, _records, _train

pytestmark = pytest.mark.timeout(240)


def _args(tmp_path, corpus_prefix, name: str) -> list[str]:
    # The LR horizon fixed: the reference run and the stopped one train the same schedule.
    return [*_common(tmp_path / name, corpus_prefix, name), "optim.decay_iters=1000"]


def _digest(tmp_path, name: str) -> str:
    return _records(f"{tmp_path / name}/run")[-1]["state_digest"]


def test_exit_interval_stops_at_each_multiple_and_the_relaunches_end_bit_exact(tmp_path, corpus_prefix):
    args = _args(tmp_path, corpus_prefix, "interval")
    for end in (4, 8):
        proc = _train([*args, "train.iters=9", "train.exit_interval=4"])
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert f"stopped by train.exit_interval=4 at step {end}; relaunch the same command to resume from step " \
               f"{end}" in proc.stderr
        assert "done:" not in proc.stdout
        summary = _records(f"{tmp_path}/interval/run")[-1]
        assert (summary["step"], summary["checkpoint_saved_step"]) == (end, end)  # durable
    last = _train([*args, "train.iters=9", "train.exit_interval=4"])
    assert last.returncode == 0 and "done: step 9" in last.stdout, last.stderr[-2000:]
    assert _train([*_args(tmp_path, corpus_prefix, "ref"), "train.iters=9"]).returncode == 0
    assert _digest(tmp_path, "interval") == _digest(tmp_path, "ref")


def test_exit_duration_stops_before_the_limit_durable_and_the_relaunch_resumes_bit_exact(tmp_path, corpus_prefix):
    args = _args(tmp_path, corpus_prefix, "timed")
    limit_s = 15.0
    start = time.monotonic()
    proc = _train([*args, "train.iters=1000", f"train.exit_duration_in_mins={limit_s / 60}"])
    wall = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = _records(f"{tmp_path}/timed/run")[-1]
    step = summary["step"]
    assert f"stopped by train.exit_duration_in_mins={limit_s / 60} at step {step}; relaunch the same command to " \
           f"resume from step {step}" in proc.stderr
    assert summary["checkpoint_saved_step"] == step and 0 < step < 1000
    # The clock starts with the process, so only the drain after the last step may pass the limit.
    assert wall < limit_s + 5.0, wall
    again = _train([*args, f"train.iters={step + 3}"])
    assert again.returncode == 0, again.stderr[-2000:]
    rec = next(r for r in _records(f"{tmp_path}/timed/run") if r.get("event") == "recovery")
    assert (rec["end"], rec["steps_lost"], rec["failure_class"]) == (step, 0, "none")
    assert _train([*_args(tmp_path, corpus_prefix, "ref"), f"train.iters={step + 3}"]).returncode == 0
    assert _digest(tmp_path, "timed") == _digest(tmp_path, "ref")


def test_a_bad_limit_is_one_line_and_exit_2():
    proc = _train(["model=tiny", "train.exit_interval=0"])
    assert proc.returncode == 2
    assert proc.stderr.strip() == "config error: train.exit_interval=0 must be positive (or unset: no stop by " \
                                  "step count)"


def test_the_duration_counts_the_longest_step_twice():
    limit = TimeLimit(exit_duration_in_mins=1.0, started=time.monotonic() - 50.0)
    assert not limit.duration_due(1)
    limit._seen = (1, time.monotonic() - 4.0)  # step 1 took 4 s: 50 + 2 x 4 < 60
    assert not limit.duration_due(2)
    limit._seen = (2, time.monotonic() - 6.0)  # 50 + 2 x 6 >= 60: step 4 could end past the limit
    assert limit.duration_due(3)


def test_the_clock_starts_with_the_process():
    assert 0.0 < time.monotonic() - process_start() < 3600.0


def test_the_agreed_cause_is_the_first_any_rank_voted_for():
    assert StopRequest.agreed([0.0, 0.0, 0.0, 0.0]) is None
    assert StopRequest.agreed([0.0, 1.0, 0.0, 1.0]) == "SIGTERM"  # a signal outranks a time limit
    assert StopRequest.agreed([0.0, 0.0, 2.0, 0.0]) == "train.exit_interval"
    stop = StopRequest()
    stop.set_limits(exit_interval=None, exit_duration_in_mins=1e-9)
    assert stop.flags(5, decides=False) == [0.0, 0.0, 0.0, 0.0]  # only rank 0 judges the clock
    assert stop.flags(5, decides=True) == [0.0, 0.0, 0.0, 1.0]
