"""model.init_from=<format>:<path>: a source MegaTier cannot continue is a config error naming the field."""
from __future__ import annotations

import pytest

from megatier.config import ConfigError, ModelConfig, OptimConfig
from megatier.training.job_import import load_job


def test_a_source_that_is_not_a_checkpoint_names_the_field_and_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"model.init_from='torchtitan:.*step-N"):
        load_job(f"torchtitan:{tmp_path}", ModelConfig(name="l", arch="llama"), 256, OptimConfig())
    with pytest.raises(ConfigError, match=r"model.init_from='torch_dist:.*latest_checkpointed_iteration"):
        load_job(f"torch_dist:{tmp_path}", ModelConfig(name="g"), 256, OptimConfig())
    with pytest.raises(ConfigError, match=r"torchtitan checkpoints hold a llama model but model.arch=gpt2"):
        load_job(f"torchtitan:{tmp_path}", ModelConfig(name="g"), 256, OptimConfig())
