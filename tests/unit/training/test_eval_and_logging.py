"""train.eval_only, train.log_interval and logging.tensorboard through megatier-train (Megatron's --eval-only,
--log-interval and --tensorboard-dir)."""
from __future__ import annotations

import hashlib
import os

import pytest

from tests.unit.training.test_entry import _common, _records, _train

pytestmark = pytest.mark.timeout(240)


def _files(root) -> dict[str, str]:
    """Every file under ``root`` -> the sha256 of its bytes."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _scalars(log_dir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def test_tensorboard_writes_the_scalars_of_metrics_jsonl_every_log_interval_steps(tmp_path, corpus_prefix):
    args = [*_common(tmp_path, corpus_prefix, "tb"), "train.iters=7", "train.eval_interval=4",
            "logging.tensorboard=true", "train.log_interval=3"]
    proc = _train(args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    steps = [r for r in _records(f"{tmp_path}/run") if "loss" in r and "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, 8))  # metrics.jsonl keeps every step
    scalars = _scalars(tmp_path / "run" / "tensorboard")
    # multiples of 3, the step with an evaluation (4) and the last one (7)
    assert sorted(scalars["loss"]) == [3, 4, 6, 7]
    for r in steps:
        if r["step"] not in (3, 4, 6, 7):
            continue
        for key in ("loss", "lr", "grad_norm", "iter_time_s", "ckpt_stall_ms", "goodput"):
            assert scalars[key][r["step"]] == pytest.approx(r[key], rel=1e-6), (key, r["step"])
    assert set(scalars["val_loss"]) == {4, 7}
    assert scalars["val_loss"][4] == pytest.approx(steps[3]["val_loss"], rel=1e-6)


def test_eval_only_evaluates_the_checkpoint_as_the_run_did_and_writes_no_checkpoint(tmp_path, corpus_prefix):
    args = _common(tmp_path, corpus_prefix, "ev")
    trained = _train([*args, "train.iters=4"])
    assert trained.returncode == 0, trained.stderr[-2000:]
    run = _records(f"{tmp_path}/run")
    logged = next(r for r in run if r.get("step") == 4 and "val_loss" in r and "event" not in r)["val_loss"]
    before = _files(tmp_path / "shm")
    assert before
    proc = _train([*args, "train.iters=4", "train.eval_only=true"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _files(tmp_path / "shm") == before  # nothing written, nothing removed
    records = _records(f"{tmp_path}/run")
    evaluated = next(r for r in records if r.get("event") == "eval_only")
    assert (evaluated["step"], evaluated["val_loss"]) == (4, logged)  # bit for bit: the same state, same batches
    assert not any("loss" in r and "event" not in r for r in records)  # no step trained
    summary = records[-1]
    assert summary["state_digest"] == run[-1]["state_digest"]  # the restored state is the trained one
    assert f"eval-only: job 'ev' at step 4: val_loss {logged:.4f} over train.eval_iters=2 batches" in proc.stdout
    assert f"eval-only: state_digest {summary['state_digest']} at step 4" in proc.stdout
    assert "done:" not in proc.stdout  # nothing was trained


def test_eval_only_without_a_checkpoint_is_one_line_and_exit_2(tmp_path, corpus_prefix):
    proc = _train([*_common(tmp_path, corpus_prefix, "none"), "train.iters=4", "train.eval_only=true"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: train.eval_only=true: no checkpoints of job "
                                                   "'none'"), proc.stderr
    assert not os.listdir(tmp_path / "shm") if os.path.exists(tmp_path / "shm") else True


def test_eval_only_with_checkpointing_off_is_one_line_and_exit_2():
    proc = _train(["model=tiny", "checkpoint=disabled", "train.eval_only=true"])
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("config error: train.eval_only=true evaluates the job's checkpoint, but "
                                   "checkpointing is off (checkpoint=disabled); launch it with the checkpoint "
                                   "settings the job trained with (e.g. checkpoint=tiered)")
