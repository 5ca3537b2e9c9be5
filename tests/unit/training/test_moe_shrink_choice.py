"""An in-process shrink of an expert-parallel job keeps parallel.ep: a data-parallel degree that ep does not
divide is not trainable, so the membership decider (which asks ``trainable_dp``) never picks it."""
import pytest

from megatier.config import ConfigError
from megatier.config.validation import validate
from megatier.training.inprocess import trainable_dp


def test_a_shrink_of_an_ep2_job_refuses_a_dp_that_ep_does_not_divide(compose_config):
    cfg = compose_config("model=tiny_moe", "parallel.ep=2", "data.seq_len=64")
    assert trainable_dp(cfg, 2)
    assert not trainable_dp(cfg, 1) and not trainable_dp(cfg, 3)
    with pytest.raises(ConfigError, match=r"^parallel\.ep=2 does not divide the data-parallel degree 3 "):
        validate(cfg, 3)
