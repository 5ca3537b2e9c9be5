"""Override keys are checked against the schema before Hydra runs: an unknown one is one line naming the closest."""
from __future__ import annotations

import pytest

from megatier.config import ConfigError, compose_config
from megatier.config.keys import all_keys, check_override_keys, closest, unknown_key

GROUPS = {"model", "parallel", "optim", "data", "checkpoint", "logging", "experiment"}


def test_known_keys_and_group_choices_pass():
    check_override_keys(["model=tiny", "train.iters=3", "+checkpoint.tiers=[local]", "checkpoint.remote.url=x",
                         "~model.init_from", "hydra.run.dir=x", "experiment=demo", "logging.wandb.tags=[a,b]"],
                        GROUPS)


@pytest.mark.parametrize("override,bad,near", [
    ("+train.iter=5", "train.iter", "train.iters"),
    ("train.iter=5", "train.iter", "train.iters"),
    ("checkpoint.diff.bach=3", "checkpoint.diff.bach", "checkpoint.diff.batch"),
    ("trian.iters=3", "trian", "train"),
])
def test_an_unknown_key_names_itself_and_the_closest(override, bad, near):
    with pytest.raises(ConfigError) as e:
        check_override_keys([override], GROUPS)
    assert str(e.value) == f"unknown config key {bad} (in the override {override!r}); did you mean {near}?"


def test_schema_walk():
    keys = all_keys()
    assert "train.iters" in keys and "checkpoint.remote.drain_timeout_s" in keys and "checkpoint" in keys
    assert unknown_key("checkpoint.tiers") is None and unknown_key("checkpoint.tierz") == "checkpoint.tierz"
    assert closest("zzzzzz") is None


def test_compose_errors_are_one_line():
    with pytest.raises(ConfigError, match=r"^Could not find 'model/nope' Available options in 'model': .*tiny_moe$"):
        compose_config(["model=nope"])
    with pytest.raises(ConfigError, match="train.iters=abc: Value 'abc' of type 'str' could not be converted"):
        compose_config(["train.iters=abc"])
    with pytest.raises(ConfigError, match=r"^Could not append to config. An item is already at 'train.iters'"):
        compose_config(["+train.iters=3"])
    assert compose_config(["model=tiny", "++train.iters=3"]).train.iters == 3
