"""The config fingerprint: which settings make two runs' checkpoints incompatible."""
from __future__ import annotations

from megatier.config.fingerprint import changed_keys, fingerprint_hash, state_fingerprint


def test_state_shaping_settings_are_in_it_and_bookkeeping_is_not(compose_config):
    base = compose_config("model=tiny")
    fp = state_fingerprint(base, "abc")
    assert {"optim.lr", "train.seed", "train.precision", "model.hidden_size", "parallel.tp", "data.checksum",
            "optim.decay_iters", "train.global_batch_size"} <= set(fp)
    for same in (["train.eval_interval=7"], ["logging.name=other"], ["checkpoint=tiered"], ["train.threads=1"],
                 ["train.device=cpu"], ["model.impl=te", "model.layernorm_impl=apex", "optim.grad_norm_impl=apex"]):
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
