"""train.log_interval, train.eval_only and logging.tensorboard: defaults, checks, hints and the fingerprint."""
from __future__ import annotations

import importlib.util

import pytest

from megatier.config import ConfigError, validate
from megatier.config.fingerprint import state_fingerprint
from megatier.config.keys import closest
from megatier.observe.metrics import MetricsLogger


def test_the_defaults_keep_todays_behaviour(compose_config):
    cfg = compose_config("model=tiny", "logging.run_dir=/tmp/x")
    assert (cfg.train.log_interval, cfg.train.eval_only, cfg.logging.tensorboard) == (1, False, False)
    assert cfg.logging.tensorboard_dir == "/tmp/x/tensorboard"  # under the run directory
    validate(cfg)


@pytest.mark.parametrize("value", [0, -2])
def test_a_log_interval_below_one_is_refused(compose_config, value):
    with pytest.raises(ConfigError, match=rf"^train.log_interval={value} must be positive \(1: log every step\)$"):
        validate(compose_config("model=tiny", f"train.log_interval={value}"))


def test_tensorboard_without_its_package_is_one_line_naming_the_field_and_the_fix(compose_config, monkeypatch):
    cfg = compose_config("model=tiny", "logging.tensorboard=true")
    validate(cfg)  # installed here (the dev extra)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert str(e.value) == ("logging.tensorboard=true needs the tensorboard package, which is not installed; install "
                            "it (pip install 'megatier[tensorboard]', or pip install tensorboard) or set "
                            "logging.tensorboard=false")


def test_eval_only_needs_checkpointing(compose_config):
    validate(compose_config("model=tiny", "checkpoint=tiered", "train.eval_only=true"))
    with pytest.raises(ConfigError, match=r"^train.eval_only=true evaluates the job's checkpoint, but checkpointing "
                                          r"is off \(checkpoint=disabled\)"):
        validate(compose_config("model=tiny", "checkpoint=disabled", "train.eval_only=true"))


def test_the_new_keys_leave_the_fingerprint_alone(compose_config):
    """An eval-only launch, or one logging differently, reads the job's checkpoints without a config refusal."""
    base = state_fingerprint(compose_config("model=tiny"), "c")
    assert state_fingerprint(compose_config("model=tiny", "train.eval_only=true", "train.log_interval=10",
                                            "logging.tensorboard=true"), "c") == base


@pytest.mark.parametrize("key,meant", [("train.skip_train", "train.eval_only"),
                                       ("train.log_freq", "train.log_interval"),
                                       ("logging.enable_tensorboard", "logging.tensorboard")])
def test_megatron_and_torchtitan_spellings_are_pointed_at_the_keys(key, meant):
    assert closest(key) == meant


def test_log_interval_thins_the_watched_sinks_but_not_metrics_jsonl(compose_config, tmp_path):
    cfg = compose_config("model=tiny", "logging.wandb.mode=disabled", "logging.progress=false")
    logger = MetricsLogger(cfg.logging, str(tmp_path), {"train": {"log_interval": 5}}, total_steps=12)
    seen = []
    logger._open()
    logger._tensorboard = type("Sink", (), {"log": lambda self, s, step: seen.append(step), "close": lambda self: 0})()
    for step in range(1, 13):
        logger.log({"step": step, "loss": 1.0, **({"val_loss": 2.0} if step == 7 else {})})
    logger.log({"step": 3, "event": "recovery", "end": 3})
    logger.close()
    assert seen == [5, 7, 10, 12, 3]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 13
