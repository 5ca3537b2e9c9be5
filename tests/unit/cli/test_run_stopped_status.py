"""megatier-run stopped by a signal ends with its workers' own statuses: torchrun's agent forgets them, so each
worker leaves its status in the launch's folder, and a worker that left none (killed, or still draining when
torchrun gave up on it) makes the launch a death by that signal."""
from __future__ import annotations

import signal

import pytest

from megatier.cli.run import _stopped_status
from megatier.training import outcome


def _ended(tmp_path, monkeypatch, statuses: dict[int, int]) -> None:
    monkeypatch.setenv(outcome.STATUS_DIR, str(tmp_path))
    for local_rank, status in statuses.items():
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))
        outcome.record_status(status)


@pytest.mark.parametrize("statuses,expected", [
    ({0: 0, 1: 0}, 0),  # a SIGTERM drained on every worker: ended well
    ({0: 3, 1: 0}, 3),  # ... with Tier-3 behind on rank 0
    ({0: 130, 1: 130}, 130),  # Ctrl-C
    ({0: 0}, 128 + signal.SIGTERM),  # local rank 1 left no status: it did not end on its own
])
def test_the_launch_ends_with_the_worst_worker_status_when_each_recorded_one(tmp_path, monkeypatch, statuses,
                                                                              expected):
    _ended(tmp_path, monkeypatch, statuses)
    assert _stopped_status(str(tmp_path), "2", signal.SIGTERM) == expected


def test_a_worker_count_torchrun_resolves_itself_is_the_signal_s_death(tmp_path, monkeypatch):
    _ended(tmp_path, monkeypatch, {0: 0})
    assert _stopped_status(str(tmp_path), "auto", signal.SIGINT) == 130


def test_a_command_outside_megatier_run_records_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(outcome.STATUS_DIR, raising=False)
    monkeypatch.chdir(tmp_path)
    outcome.record_status(0)
    assert list(tmp_path.iterdir()) == []


def test_a_worker_that_outlived_its_launch_still_ends_with_its_status(tmp_path, monkeypatch):
    monkeypatch.setenv(outcome.STATUS_DIR, str(tmp_path / "gone"))  # megatier-run removed its folder
    outcome.record_status(0)
    assert not (tmp_path / "gone").exists()
