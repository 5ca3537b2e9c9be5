"""The goodput ledger: its parts add up to the wall time across launches, and a restore turns the steps past its
end into lost work at the times they took."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from megatier.observe.goodput import FILENAME, MAX_WINDOW, PARTS, GoodputLedger

STEP_S, STALL_S, BOOKKEEPING_S = 0.10, 0.01, 0.002


class Clock:
    """A wall clock the test moves by hand."""

    def __init__(self, t: float = 1_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _open(run_dir, clock, job="job", fingerprint="fp") -> GoodputLedger:
    return GoodputLedger.open(str(run_dir), job, fingerprint, started=clock(), clock=clock)


def _train(ledger: GoodputLedger, clock: Clock, steps, *, eval_at=(), eval_s=0.05, durable=None) -> dict:
    """Steps of STEP_S with a STALL_S checkpoint wait and BOOKKEEPING_S of loop bookkeeping each."""
    fields = {}
    for s in steps:
        clock.t += BOOKKEEPING_S + STEP_S + STALL_S
        record = {"step": s, "iter_time_s": STEP_S, "ckpt_stall_ms": 1000 * STALL_S, "rpo_rack": durable}
        if s in eval_at:
            clock.t += eval_s
            record["eval_time_s"] = eval_s
        fields = ledger.step(record)
    return fields


def _adds_up(fields: dict) -> None:
    assert sum(fields[f"goodput_{p}_s"] for p in PARTS) == pytest.approx(fields["goodput_wall_s"], abs=1e-9)
    assert all(fields[f"goodput_{p}_s"] >= 0 for p in PARTS)
    assert fields["goodput"] == pytest.approx(fields["goodput_productive_s"] / fields["goodput_wall_s"])


def test_a_failure_a_restore_and_more_steps_add_up_to_the_wall_time(tmp_path):
    clock = Clock()
    t0 = clock()
    ledger = _open(tmp_path, clock)
    clock.t += 2.0  # process groups, data, model
    ledger.resume(0)
    fields = _train(ledger, clock, range(1, 11), eval_at=(5,))
    _adds_up(fields)
    assert fields["goodput_productive_s"] == pytest.approx(10 * STEP_S)
    assert fields["goodput_restart_s"] == pytest.approx(2.0 + BOOKKEEPING_S)  # up to the first step's end
    assert fields["goodput_eval_s"] == pytest.approx(0.05)
    assert fields["goodput_other_s"] == pytest.approx(9 * BOOKKEEPING_S)  # the first step's is restart

    # Killed after step 10's update; relaunched 3 s later, restored to E=7 (steps 8-10 are computed again).
    clock.t += 3.0
    relaunch = _open(tmp_path, clock)
    clock.t += 1.5
    recovery = {"event": "recovery", "end": 7, "last_step": 10, "steps_lost": 3, "t_consensus_s": 0.1,
                "t_rollback_s": 0.2, "t_replay_s": 0.3}
    relaunch.resume(7, recovery)
    fields = _train(relaunch, clock, range(8, 16))
    clock.t += 0.7  # the final drain (0.5) and the digests
    fields = relaunch.close(drain_s=0.5)

    _adds_up(fields)
    assert fields["goodput_wall_s"] == pytest.approx(clock() - t0)  # nothing between the launches was idle
    assert fields["goodput_steps_lost"] == 3 and fields["goodput_restarts"] == 1
    assert fields["goodput_lost_s"] == pytest.approx(3 * STEP_S)  # steps lost x step time
    assert fields["goodput_productive_s"] == pytest.approx(15 * STEP_S)  # steps 1..15, each kept once
    assert fields["goodput_restore_s"] == pytest.approx(0.6)
    assert fields["goodput_restart_s"] == pytest.approx(2.0 + BOOKKEEPING_S + 3.0 + 1.5 + BOOKKEEPING_S - 0.6)
    assert fields["goodput_ckpt_stall_s"] == pytest.approx(18 * STALL_S + 0.5)
    assert fields["goodput_other_s"] == pytest.approx(9 * BOOKKEEPING_S + 7 * BOOKKEEPING_S + 0.2)


def test_every_step_is_persisted_whole_and_a_restart_reads_it(tmp_path):
    clock = Clock()
    ledger = _open(tmp_path, clock)
    ledger.resume(0)
    fields = _train(ledger, clock, range(1, 4))
    path = tmp_path / FILENAME
    doc = json.loads(path.read_text())
    assert doc["last_step"] == 3 and doc["wall_s"] == pytest.approx(fields["goodput_wall_s"])
    assert not doc["closed"] and not os.path.exists(f"{path}.tmp")
    # A kill between two updates: the next launch continues from the file, the gap becomes restart.
    clock.t += 10.0
    again = _open(tmp_path, clock)
    again.resume(3, {"t_consensus_s": 0.0, "t_rollback_s": 0.0, "t_replay_s": 0.0})
    fields = _train(again, clock, [4])
    _adds_up(fields)
    assert fields["goodput_steps_lost"] == 0 and fields["goodput_productive_s"] == pytest.approx(4 * STEP_S)
    assert fields["goodput_restart_s"] == pytest.approx(BOOKKEEPING_S + 10.0 + BOOKKEEPING_S)


def test_a_relaunch_without_checkpoints_loses_every_step(tmp_path):
    clock = Clock()
    ledger = _open(tmp_path, clock)
    ledger.resume(0)
    _train(ledger, clock, range(1, 6))
    again = _open(tmp_path, clock)
    again.resume(0)  # same job and config, no checkpoint: it starts over
    fields = _train(again, clock, range(1, 3))
    assert fields["goodput_steps_lost"] == 5 and fields["goodput_lost_s"] == pytest.approx(5 * STEP_S)
    assert fields["goodput_productive_s"] == pytest.approx(2 * STEP_S)
    _adds_up(fields)


def test_a_clean_exit_then_a_new_run_or_a_continuation(tmp_path):
    clock = Clock()
    ledger = _open(tmp_path, clock)
    ledger.resume(0)
    _train(ledger, clock, range(1, 6))
    wall = ledger.close()["goodput_wall_s"]
    clock.t += 3600.0  # nothing is held between a clean exit and the next launch
    extended = _open(tmp_path, clock)
    clock.t += 1.0  # starting up and restoring (0.1)
    extended.resume(5, {"t_consensus_s": 0.1, "t_rollback_s": 0.0, "t_replay_s": 0.0})
    fields = _train(extended, clock, [6])
    assert fields["goodput_wall_s"] == pytest.approx(wall + 1.0 + BOOKKEEPING_S + STEP_S + STALL_S)
    assert fields["goodput_restarts"] == 0 and fields["goodput_productive_s"] == pytest.approx(6 * STEP_S)
    extended.close()
    rerun = _open(tmp_path, clock)
    rerun.resume(0)  # the finished job trained again from scratch: a new run, a new ledger
    fields = _train(rerun, clock, [1])
    assert fields["goodput_productive_s"] == pytest.approx(STEP_S) and fields["goodput_lost_s"] == 0
    other_config = _open(tmp_path, clock, fingerprint="other")
    other_config.resume(0)
    assert _train(other_config, clock, [1])["goodput_lost_s"] == 0


def test_another_jobs_or_a_corrupt_ledger_starts_afresh_with_one_warning(tmp_path, caplog):
    clock = Clock()
    ledger = _open(tmp_path, clock)
    ledger.resume(0)
    _train(ledger, clock, range(1, 4))
    with caplog.at_level(logging.WARNING, logger="megatier.observe.goodput"):
        other = _open(tmp_path, clock, job="other")
        other.resume(3)
        assert _train(other, clock, [4])["goodput_productive_s"] == pytest.approx(STEP_S)
        (tmp_path / FILENAME).write_text('{"format": 1, "job_id": "job", "wall_s": "x"')
        fresh = _open(tmp_path, clock)
        fresh.resume(4)
        fields = _train(fresh, clock, [5])
    assert fields["goodput_productive_s"] == pytest.approx(STEP_S) and fields["goodput_steps_lost"] == 0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "belongs to job 'job'" in lines[0] and "not a readable ledger" in lines[1]
    assert (tmp_path / f"{FILENAME}.corrupt").exists() and json.loads((tmp_path / FILENAME).read_text())


def test_steps_at_the_durable_point_fold_and_a_restore_behind_it_counts_their_mean(tmp_path):
    clock = Clock()
    ledger = _open(tmp_path, clock)
    ledger.resume(0)
    _train(ledger, clock, range(1, 21), durable=10)
    doc = json.loads((tmp_path / FILENAME).read_text())
    assert doc["folded_through"] == 10 and [w[0] for w in doc["window"]] == list(range(11, 21))
    again = _open(tmp_path, clock)
    again.resume(12)
    again.resume(4)  # behind the durable point (a wiped Tier-3): six folded steps and the ten after them
    fields = _train(again, clock, [5])
    assert fields["goodput_restarts"] == 1  # one launch after one failure, however often it restores
    assert fields["goodput_steps_lost"] == 16 and fields["goodput_lost_s"] == pytest.approx(16 * STEP_S)
    assert fields["goodput_productive_s"] == pytest.approx(5 * STEP_S)
    _adds_up(fields)


def test_the_window_is_bounded_without_a_durable_point(tmp_path):
    clock = Clock()
    ledger = _open(tmp_path, clock)
    ledger.resume(0)
    _train(ledger, clock, range(1, MAX_WINDOW + 11))
    doc = json.loads((tmp_path / FILENAME).read_text())
    assert len(doc["window"]) == MAX_WINDOW and doc["folded_through"] == 10


def _launch(cfg, *, finish: bool) -> list[dict]:
    from megatier.training.trainer import Trainer

    trainer = Trainer(cfg)
    trainer.train()
    if finish:
        trainer.close()
    else:  # dies after its last step: no summary, the ledger stays open
        dist.destroy_process_group()
    with open(os.path.join(cfg.logging.run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_the_trainer_logs_goodput_every_step_and_in_the_summary(tiny_config):
    crashed = _launch(tiny_config("train.iters=6"), finish=False)
    records = _launch(tiny_config("train.iters=6"), finish=True)  # no checkpointing: starts over
    steps = [r for r in records if "event" not in r]
    assert all("goodput" in r and "goodput_wall_s" in r for r in steps)
    assert [r["goodput_wall_s"] for r in steps] == sorted(r["goodput_wall_s"] for r in steps)
    assert any("eval_time_s" in r for r in steps)
    summary = records[-1]
    assert summary["event"] == "summary"
    _adds_up(summary)
    assert summary["goodput_steps_lost"] == 6 and summary["goodput_restarts"] == 1
    assert summary["goodput_lost_s"] == pytest.approx(sum(r["iter_time_s"] for r in crashed), rel=1e-9)
    assert summary["goodput_productive_s"] == pytest.approx(sum(r["iter_time_s"] for r in steps), rel=1e-9)
    assert summary["goodput_eval_s"] == pytest.approx(
        sum(r.get("eval_time_s", 0.0) for r in crashed + steps), rel=1e-9)


def test_a_relaunch_times_its_recovery_from_the_failure_to_its_first_step_in_parts_that_add_up(tmp_path):
    clock = Clock()
    ledger = _open(tmp_path, clock)
    ledger.resume(0)
    _train(ledger, clock, range(1, 11))
    failed_at = clock()  # killed right after step 10's update
    clock.t += 2.5  # the launcher notices, stops the others, starts the job again
    started = clock()
    clock.t += 4.0  # imports, process groups, data, model, checkpointer
    relaunch = GoodputLedger.open(str(tmp_path), "job", "fp", started=clock(), clock=clock, process_started=started)
    clock.t += 0.6  # the restore
    relaunch.resume(7, {"event": "recovery", "end": 7, "t_consensus_s": 0.1, "t_rollback_s": 0.2, "t_replay_s": 0.3})
    fields = _train(relaunch, clock, [8])
    assert fields["recovery_mode"] == "relaunch"
    assert fields["recovery_detection_s"] == pytest.approx(2.5)
    assert fields["recovery_reform_s"] == pytest.approx(4.0)
    assert fields["recovery_restore_s"] == pytest.approx(0.6)
    assert fields["recovery_rerun_s"] == pytest.approx(BOOKKEEPING_S + STEP_S + STALL_S)
    parts = ("detection", "reform", "restore", "rerun")
    assert sum(fields[f"recovery_{p}_s"] for p in parts) == pytest.approx(fields["recovery_total_s"])
    assert fields["recovery_total_s"] == pytest.approx(clock() - failed_at)
    assert fields["recovery_steps_rerun"] == 3  # steps 8-10 again
    assert "recovery_total_s" not in _train(relaunch, clock, [9])  # once, on the first step after the restore


def test_an_in_place_recovery_is_timed_from_the_last_update_and_its_gap_is_restart(tmp_path):
    clock = Clock()
    ledger = _open(tmp_path, clock)
    ledger.resume(0)
    before = _train(ledger, clock, range(1, 11))
    failed_at = clock()
    clock.t += 0.05  # a survivor's collective fails
    detected = clock()
    clock.t += 0.3  # threads stopped, the round, new process groups and checkpointer
    clock.t += 0.2  # the restore
    ledger.resume(9, {"event": "recovery", "end": 9, "t_consensus_s": 0.05, "t_rollback_s": 0.05,
                      "t_replay_s": 0.1}, detected_at=detected)
    fields = _train(ledger, clock, [10])
    assert fields["recovery_mode"] == "inprocess" and fields["recovery_steps_rerun"] == 1
    assert fields["recovery_detection_s"] == pytest.approx(0.05)
    assert fields["recovery_reform_s"] == pytest.approx(0.3)
    assert fields["recovery_restore_s"] == pytest.approx(0.2)
    assert fields["recovery_total_s"] == pytest.approx(clock() - failed_at)
    _adds_up(fields)
    assert fields["goodput_restarts"] == before["goodput_restarts"] + 1
    assert fields["goodput_restore_s"] == pytest.approx(0.2)  # the record's, not the launch's start-up
    gap = fields["goodput_restart_s"] - before["goodput_restart_s"]
    assert gap == pytest.approx(0.05 + 0.3 + BOOKKEEPING_S)  # detection, re-form and the loop's bookkeeping
    assert fields["goodput_steps_lost"] == 1


def test_a_new_rank_0_in_place_continues_the_launch_it_joins(tmp_path):
    clock = Clock()
    ledger = _open(tmp_path, clock)
    ledger.resume(0)
    before = _train(ledger, clock, range(1, 6))
    detected = clock.t = clock.t + 0.05  # rank 0 died; a spare (or a survivor) takes its rank and its ledger
    clock.t += 0.4
    heir = _open(tmp_path, clock)
    heir.resume(4, {"event": "recovery", "end": 4, "t_consensus_s": 0.1}, detected_at=detected)
    fields = _train(heir, clock, [5])
    assert fields["recovery_mode"] == "inprocess"
    assert heir.state.launches == ledger.state.launches == 1  # the same launch goes on
    assert fields["goodput_restarts"] == before["goodput_restarts"] + 1


def test_a_continuation_after_a_clean_exit_times_no_recovery(tmp_path):
    clock = Clock()
    ledger = _open(tmp_path, clock)
    ledger.resume(0)
    _train(ledger, clock, range(1, 4))
    ledger.close()
    clock.t += 60.0
    again = _open(tmp_path, clock)
    again.resume(3, {"event": "recovery", "end": 3, "t_consensus_s": 0.1})
    assert not any(k.startswith("recovery_") for k in _train(again, clock, [4]))


def test_the_process_start_is_read_from_the_system():
    # A new process, not this test's worker: a worker may have started long before the test runs.
    before = time.time()
    out = subprocess.run([sys.executable, "-c", "from megatier.observe.goodput import process_started; "
                          "print(repr(process_started()))"], capture_output=True, text=True, check=True).stdout
    started = float(out)
    assert before - 1.0 < started <= time.time()  # to the kernel's clock tick
