"""A run resumes only its own job: another configuration under the same job id is refused, by name."""
from __future__ import annotations

import json

import pytest

from megatier.checkpoint.recover.inventory import RecoveryError
from megatier.training.trainer import Trainer

pytestmark = pytest.mark.timeout(120)


def _common(tmp_path) -> list[str]:
    return ["checkpoint=tiered", "checkpoint.tiers=[local,remote]", f"checkpoint.local.root={tmp_path / 'shm'}",
            f"checkpoint.remote.url={tmp_path / 't3'}", "checkpoint.base_interval=10", "checkpoint.job_id=same",
            "optim.decay_iters=40"]


def _train(cfg) -> list[dict]:
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    with open(f"{cfg.logging.run_dir}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_another_config_is_refused_and_an_allowed_change_resumes(tiny_config, tmp_path):
    _train(tiny_config(*_common(tmp_path), "train.iters=20"))
    changed = ["optim.lr=1e-3", "train.seed=7", f"logging.run_dir={tmp_path / 'run2'}"]
    trainer = Trainer(tiny_config(*_common(tmp_path), "train.iters=20", *changed))
    with pytest.raises(RecoveryError) as e:
        trainer.train()
    message = str(e.value)
    assert "optim.lr: 0.0006 -> 0.001" in message and "train.seed: 1234 -> 7" in message, message
    assert "checkpoint.allow_changes=[optim.lr,train.seed]" in message
    allowed = "checkpoint.allow_changes=[optim.lr,train.seed]"
    records = _train(tiny_config(*_common(tmp_path), "train.iters=25", *changed, allowed,
                                 f"logging.run_dir={tmp_path / 'run3'}"))
    recovery = next(r for r in records if r.get("event") == "recovery")
    assert (recovery["version"], recovery["end"]) == (20, 20)
    steps = [r["step"] for r in records if "loss" in r and "event" not in r]
    assert steps == [21, 22, 23, 24, 25]


def test_a_longer_run_of_the_same_config_resumes(tiny_config, tmp_path):
    _train(tiny_config(*_common(tmp_path), "train.iters=10"))
    records = _train(tiny_config(*_common(tmp_path), "train.iters=15", f"logging.run_dir={tmp_path / 'run2'}"))
    assert next(r for r in records if r.get("event") == "recovery")["end"] == 10
