"""The config fingerprint: which settings make two runs' checkpoints incompatible."""
from __future__ import annotations

from megatier.config.fingerprint import (
    SCHEDULE_KEYS,
    changed_keys,
    fingerprint_hash,
    fingerprint_keys,
    followed_keys,
    state_fingerprint,
)


def test_state_shaping_settings_are_in_it_and_bookkeeping_is_not(compose_config):
    base = compose_config("model=tiny")
    fp = state_fingerprint(base, "abc")
    assert {"optim.lr", "train.seed", "train.precision", "model.hidden_size", "parallel.tp", "data.checksum",
            "optim.decay_iters", "train.global_batch_size"} <= set(fp)
    assert {"optim.decay_style", "optim.wsd_decay_iters", "optim.warmup_fraction",
            "train.rampup_batch_size"} <= fingerprint_keys()
    for same in (["train.eval_interval=7"], ["logging.name=other"], ["checkpoint=tiered"], ["train.threads=1"],
                 ["train.device=cpu"], ["model.impl=te", "model.layernorm_impl=apex", "optim.grad_norm_impl=apex"],
                 ["optim.use_checkpoint_scheduler=true"]):
        assert fingerprint_hash(state_fingerprint(compose_config("model=tiny", *same), "abc")) == \
            fingerprint_hash(fp), same
    fixed = compose_config("model=tiny", "optim.decay_iters=100")
    longer = compose_config("model=tiny", "optim.decay_iters=100", "train.iters=500")
    assert state_fingerprint(fixed, "abc") == state_fingerprint(longer, "abc")  # iters alone: train longer
    assert fingerprint_hash(state_fingerprint(base, "abd")) != fingerprint_hash(fp)  # other data


def test_iters_matter_while_they_set_the_lr_schedule(compose_config):
    short, long = compose_config("model=tiny", "train.iters=10"), compose_config("model=tiny", "train.iters=20")
    assert changed_keys(state_fingerprint(short, "x"), state_fingerprint(long, "x")) == ["optim.decay_iters: 10 -> 20"]


def test_changed_keys_name_old_and_new():
    assert changed_keys({"a": "1", "b": "2"}, {"a": "1", "b": "3", "c": "4"}) == ["b: 2 -> 3", "c: (unset) -> 4"]
    assert fingerprint_hash({}) == ""


def test_use_checkpoint_scheduler_follows_every_schedule_key_and_only_those(compose_config):
    assert followed_keys(compose_config("model=tiny")) == ("optim.decay_iters",)
    assert followed_keys(compose_config("model=tiny", "optim.decay_iters=50")) == ()
    keys = followed_keys(compose_config("model=tiny", "optim.decay_iters=50", "optim.use_checkpoint_scheduler=true"))
    assert keys == SCHEDULE_KEYS and set(keys) <= fingerprint_keys()
    assert not {"optim.beta1", "optim.weight_decay", "optim.clip_grad"} & set(keys)


def test_keys_added_later_leave_an_older_jobs_fingerprint_as_it_was():
    """At the values that train as before they existed, the schedule and ramp keys are not recorded, so a job
    checkpointed before them is still its own job after an upgrade; set away from those values, they count."""
    from megatier.config import compose_config
    from megatier.config.fingerprint import ADDED_LATER, state_fingerprint

    plain = state_fingerprint(compose_config(["model=tiny"]), "abc")
    assert not set(ADDED_LATER) & set(plain)
    wsd = state_fingerprint(compose_config(["model=tiny", "optim.decay_style=wsd", "optim.wsd_decay_iters=5"]), "abc")
    assert wsd["optim.decay_style"] == '"wsd"' and wsd["optim.wsd_decay_iters"] == "5"
