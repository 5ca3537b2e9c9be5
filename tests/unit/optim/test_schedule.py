"""The LR schedules equal Megatron-core's OptimizerParamScheduler step for step, bit for bit."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from megatier.config import OptimConfig
from megatier.data.ramp import BatchRamp
from megatier.optim.schedule import LRSchedule, schedule_of
from tests.unit.data.test_ramp import megatron_batches

mcore = pytest.importorskip("megatron.core.optimizer_param_scheduler",
                            reason="megatron-core (a test dependency: make install) is not importable")

ITERS, WARMUP, DECAY, WSD = 60, 6, 48, 15  # warmup, then stable or decay phases, then past the horizon


def _megatron_lrs(o: OptimConfig, gbs: int, iters: int, batches: list[int] | None = None) -> list[float]:
    """Megatron's scheduler as its training loop sets it up for --train-iters: every count in samples
    (megatron.training.training.get_optimizer_param_scheduler), stepped by one global batch per iteration
    (``batches``: each iteration's, during a ramp-up)."""
    decay = o.decay_iters * gbs
    warmup = o.warmup_fraction * decay if o.warmup_fraction is not None else o.warmup_iters * gbs
    group = {}
    sched = mcore.OptimizerParamScheduler(
        SimpleNamespace(param_groups=[group]), init_lr=o.warmup_init_lr, max_lr=o.lr, min_lr=o.min_lr,
        lr_warmup_steps=warmup, lr_decay_steps=decay, lr_decay_style="WSD" if o.decay_style == "wsd" else o.decay_style,
        start_wd=0.1, end_wd=0.1, wd_incr_steps=iters * gbs, wd_incr_style="constant",
        wsd_decay_steps=o.wsd_decay_iters * gbs if o.wsd_decay_iters else None, lr_wsd_decay_style=o.wsd_decay_style)
    lrs = []
    for batch in batches or [gbs] * iters:
        sched.step(increment=batch)
        lrs.append(group["lr"])
    return lrs


CASES = [dict(decay_style=s) for s in ("constant", "linear", "cosine", "inverse-square-root")] + [
    dict(decay_style="wsd", wsd_decay_iters=WSD, wsd_decay_style=s)
    for s in ("exponential", "linear", "cosine", "minus_sqrt")] + [
    dict(decay_style="cosine", warmup_iters=0, warmup_fraction=0.13, warmup_init_lr=1e-5),
    dict(decay_style="wsd", wsd_decay_iters=WSD, warmup_iters=0, warmup_fraction=0.05),
    dict(decay_style="linear", warmup_iters=0),
]


@pytest.mark.parametrize("gbs", [1, 8, 24])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_every_decay_style_equals_megatron_core_step_for_step(case, gbs):
    o = OptimConfig(**{"lr": 3e-4, "min_lr": 3e-5, "warmup_iters": WARMUP, "decay_iters": DECAY, **case})
    ours = schedule_of(o, ITERS, gbs)
    assert [ours(step) for step in range(1, ITERS + 1)] == _megatron_lrs(o, gbs, ITERS)


def test_wsd_warms_up_holds_then_decays_to_min_lr():
    s = LRSchedule(1.0, 0.1, WARMUP, DECAY, decay_style="wsd", batch=4, wsd_decay_iters=WSD)
    lrs = [s(step) for step in range(1, ITERS + 1)]
    assert lrs[:WARMUP] == sorted(lrs[:WARMUP]) and lrs[WARMUP - 1] == 1.0
    assert set(lrs[WARMUP:DECAY - WSD]) == {1.0}  # stable
    decay = lrs[DECAY - WSD:DECAY]
    assert decay == sorted(decay, reverse=True) and decay[0] < 1.0 and decay[-1] == 0.1
    assert set(lrs[DECAY:]) == {0.1}


def test_a_followed_record_replaces_the_schedule_keys_it_holds():
    s = schedule_of(OptimConfig(decay_style="cosine"), 100, 8)
    recorded = {"optim.decay_style": json.dumps("wsd"), "optim.wsd_decay_iters": "20", "optim.lr": "0.001",
                "optim.beta1": "0.5"}
    followed = s.following(recorded)
    assert (followed.decay_style, followed.wsd_decay_iters, followed.lr) == ("wsd", 20, 0.001)
    assert (followed.decay_iters, followed.batch, followed.min_lr) == (100, 8, s.min_lr)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_through_a_batch_ramp_the_rate_follows_the_samples_as_megatron_core(case):
    gbs, rampup = 16, [4, 4, 120]  # 10 batches of 4, 5 of 8, 4 of 12, then 16: through warmup and decay
    o = OptimConfig(**{"lr": 3e-4, "min_lr": 3e-5, "warmup_iters": WARMUP, "decay_iters": DECAY, **case})
    ours = schedule_of(o, ITERS, gbs, BatchRamp.of(gbs, rampup))
    batches = megatron_batches(gbs, 2, 2, rampup, ITERS)
    assert batches[0] == 4 and batches[-1] == gbs
    assert [ours(step) for step in range(1, ITERS + 1)] == _megatron_lrs(o, gbs, ITERS, batches)
    assert ours.samples_after(ITERS) == sum(batches)
