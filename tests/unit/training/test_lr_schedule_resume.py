"""A resume inside a WSD decay is bit-exact; a changed schedule is refused, followed
(optim.use_checkpoint_scheduler) or taken on purpose (checkpoint.allow_changes: Megatron's override)."""
from __future__ import annotations

import pytest

from megatier.checkpoint.recover.inventory import ConfigRefusal
from tests.unit.training.runs import train_records

pytestmark = pytest.mark.timeout(240)

WSD = ["optim.decay_style=wsd", "optim.decay_iters=16", "optim.wsd_decay_iters=8", "optim.wsd_decay_style=linear",
       "optim.warmup_iters=2", "optim.lr=3e-3", "optim.min_lr=3e-4", "train.eval_interval=1000"]


def _job(tmp_path, name: str) -> list[str]:
    return ["checkpoint=tiered", "checkpoint.tiers=[local]", f"checkpoint.local.root={tmp_path}/{name}/shm",
            "checkpoint.base_interval=5", "checkpoint.base_capture=snapshot", "checkpoint.diff.compression=fp32",
            f"logging.run_dir={tmp_path}/{name}/run", f"logging.name={name}", *WSD]


def _lrs(records: list[dict]) -> list[float]:
    return [r["lr"] for r in records if "event" not in r]


def test_a_resume_inside_the_wsd_decay_is_bit_exact(tiny_config, tmp_path):
    whole = train_records(tiny_config(*_job(tmp_path, "whole"), "train.iters=16"))
    lrs = _lrs(whole)
    assert lrs[2:8] == [3e-3] * 6 and lrs[-1] == 3e-4 and lrs[8] > lrs[9] > lrs[10]  # stable, then the decay
    first = train_records(tiny_config(*_job(tmp_path, "split"), "train.iters=11", "checkpoint.final_base=false"))
    assert _lrs(first) == lrs[:11]
    again = train_records(tiny_config(*_job(tmp_path, "split"), "train.iters=16"))
    recovery = next(r for r in again if r.get("event") == "recovery")
    assert (recovery["version"], recovery["end"]) == (10, 11)  # base v10, step 11 replayed from its diff
    assert _lrs(again) == lrs[11:]
    assert again[-1]["state_digest"] == whole[-1]["state_digest"]


def test_a_changed_schedule_is_refused_followed_or_taken_on_purpose(tiny_config, tmp_path):
    job = _job(tmp_path, "job")
    whole = train_records(tiny_config(*_job(tmp_path, "whole"), "train.iters=12"))
    train_records(tiny_config(*job, "train.iters=6"))  # still in the stable phase
    cosine = ["optim.decay_style=cosine", "optim.lr=1e-3"]
    with pytest.raises(ConfigRefusal, match="optim.decay_style"):
        train_records(tiny_config(*job, *cosine, "train.iters=8"))
    followed = train_records(tiny_config(*job, *cosine, "optim.use_checkpoint_scheduler=true", "train.iters=9"))
    assert _lrs(followed) == _lrs(whole)[6:9]  # the recorded WSD schedule, not the cosine this launch names
    # WSD's point: decay from step 9 over the next 3 steps, allowing the horizon to change (Megatron: override)
    decayed = train_records(tiny_config(*job, "optim.decay_iters=12", "optim.wsd_decay_iters=3", "train.iters=12",
                                        "checkpoint.allow_changes=[optim.decay_iters,optim.wsd_decay_iters]"))
    assert _lrs(decayed) == pytest.approx([3e-3 - (3e-3 - 3e-4) * k / 3 for k in (1, 2, 3)], rel=1e-12)
