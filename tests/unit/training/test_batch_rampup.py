"""A job stopped inside its batch-size ramp-up resumes bit-exactly: the same samples, batches and LRs."""
from __future__ import annotations

import pytest

from megatier.checkpoint.recover.inventory import ConfigRefusal
from tests.unit.training.runs import train_records

pytestmark = pytest.mark.timeout(240)

# Batches 2, 2, 2, 2, 4, 4, 6, 6, then 8 (one increment every 8 of the 24 ramp samples); a WSD decay at the end.
RAMP = ["train.global_batch_size=8", "train.micro_batch_size=2", "train.rampup_batch_size=[2,2,24]",
        "optim.decay_style=wsd", "optim.decay_iters=12", "optim.wsd_decay_iters=4", "optim.warmup_iters=2",
        "optim.lr=3e-3", "optim.min_lr=3e-4", "train.eval_interval=1000"]


def _job(tmp_path, name: str) -> list[str]:
    return ["checkpoint=tiered", "checkpoint.tiers=[local]", f"checkpoint.local.root={tmp_path}/{name}/shm",
            "checkpoint.base_interval=5", "checkpoint.base_capture=snapshot", "checkpoint.diff.compression=fp32",
            f"logging.run_dir={tmp_path}/{name}/run", f"logging.name={name}", *RAMP]


def _steps(records: list[dict]) -> list[tuple]:
    return [(r["step"], r["consumed_samples"], r["lr"], r["loss"]) for r in records if "event" not in r]


def test_a_job_stopped_mid_ramp_resumes_bit_exactly(tiny_config, tmp_path):
    whole = train_records(tiny_config(*_job(tmp_path, "whole"), "train.iters=12"))
    consumed = [c for _, c, _, _ in _steps(whole)]
    assert consumed == [2, 4, 6, 8, 12, 16, 22, 28, 36, 44, 52, 60]
    first = train_records(tiny_config(*_job(tmp_path, "split"), "train.iters=6", "checkpoint.final_base=false"))
    assert _steps(first) == _steps(whole)[:6]
    again = train_records(tiny_config(*_job(tmp_path, "split"), "train.iters=12"))
    recovery = next(r for r in again if r.get("event") == "recovery")
    assert (recovery["version"], recovery["end"]) == (5, 6)  # base v5, step 6 replayed from its diff
    assert _steps(again) == _steps(whole)[6:]
    assert again[-1]["state_digest"] == whole[-1]["state_digest"]
    with pytest.raises(ConfigRefusal, match="train.rampup_batch_size"):  # the ramp shapes the state
        train_records(tiny_config(*_job(tmp_path, "split"), "train.iters=14", "train.rampup_batch_size=[4,4,24]"))
