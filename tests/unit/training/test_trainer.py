"""Whole-run behaviour of the single-process trainer."""
from __future__ import annotations

import logging
import os

import pytest

from megatier.checkpoint.recover.inventory import ConfigRefusal
from tests.unit.training.runs import train_records


def test_thirty_steps_reduce_loss(tiny_config):
    records = train_records(tiny_config("train.iters=30", "optim.lr=3e-3", "optim.warmup_iters=3"))
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == list(range(1, 31))
    for key in ("loss", "lr", "grad_norm", "iter_time_s", "tokens_per_s"):
        assert all(isinstance(r[key], float) for r in steps), key
    assert sum(r["loss"] for r in steps[-5:]) / 5 < steps[0]["loss"] - 1.0
    assert any("val_loss" in r for r in steps)
    assert records[-1]["event"] == "summary" and len(records[-1]["state_digest"]) == 16


def test_same_seed_is_bit_identical_other_seed_differs(tiny_config, tmp_path):
    a = train_records(tiny_config(f"logging.run_dir={tmp_path / 'a'}"))
    b = train_records(tiny_config(f"logging.run_dir={tmp_path / 'b'}"))
    c = train_records(tiny_config(f"logging.run_dir={tmp_path / 'c'}", "train.seed=99"))
    assert [r.get("loss") for r in a] == [r.get("loss") for r in b]
    assert a[-1]["state_digest"] == b[-1]["state_digest"]
    assert c[-1]["state_digest"] != a[-1]["state_digest"]


def test_rerun_keeps_earlier_metrics(tiny_config):
    cfg = tiny_config("train.iters=2")
    train_records(cfg)
    train_records(cfg)
    assert os.path.exists(os.path.join(cfg.logging.run_dir, "metrics.1.jsonl"))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_trains(tiny_config, precision):
    records = train_records(tiny_config(f"train.precision={precision}", "train.iters=8", "optim.lr=3e-3"))
    steps = [r for r in records if "event" not in r]
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert ("loss_scale" in steps[0]) == (precision == "fp16")


def test_wandb_offline_writestrain_records(tiny_config, tmp_path):
    cfg = tiny_config("train.iters=2", "logging.wandb.mode=offline", f"logging.run_dir={tmp_path / 'w'}")
    train_records(cfg)
    runs = os.listdir(tmp_path / "w" / "wandb")
    assert any(name.startswith("offline-run-") for name in runs)


def test_training_longer_keeps_the_schedule_of_the_first_launch(tiny_config, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    common = ["checkpoint=tiered", "checkpoint.tiers=[local]", f"checkpoint.local.root={tmp_path}/shm",
              "checkpoint.base_interval=10", "optim.min_lr=1e-5", "optim.warmup_iters=2"]
    first = train_records(tiny_config(*common, "train.iters=8"))
    assert first[7]["lr"] == 1e-5  # decayed to min_lr at train.iters=8, the horizon the job records
    longer = train_records(tiny_config(*common, "train.iters=12"))  # no optim.decay_iters: not a config change
    recovery = next(r for r in longer if r.get("event") == "recovery")
    assert recovery["end"] == 8 and recovery["adopted"] == {"optim.decay_iters": "8"}
    assert [r["lr"] for r in longer if "event" not in r] == [1e-5] * 4  # steps 9-12 past the recorded horizon
    assert "following the LR schedule of job" in caplog.text
    with pytest.raises(ConfigRefusal, match="optim.decay_iters: 8 -> 20"):  # set explicitly: a change guarded
        train_records(tiny_config(*common, "train.iters=14", "optim.decay_iters=20"))
