"""Config composition and cross-field validation."""
from __future__ import annotations

import subprocess
import sys

import pytest
from hydra.errors import ConfigCompositionException

from megatier.config import ConfigError, validate
from tests.conftest import REPO


def test_presets_compose_and_validate(compose_config):
    for model in ("tiny", "small", "gpt2_124m", "gpt2_10b", "gpt2_20b", "gpt2_40b", "llama_tiny", "llama_small",
                  "llama3_8b", "llama3_70b"):
        cfg = compose_config(f"model={model}", "data.seq_len=128")
        validate(cfg)
        assert cfg.model.name == model


def test_paper_presets_have_table2_sizes(compose_config):
    from megatier.model.params import count_parameters

    expected = {"gpt2_10b": 9.9e9, "gpt2_20b": 20.2e9, "gpt2_40b": 40.3e9}
    for model, size in expected.items():
        cfg = compose_config(f"model={model}")
        assert abs(count_parameters(cfg.model, 50304) - size) / size < 0.02, model
    assert count_parameters(compose_config("model=tiny").model, 384) < 1_000_000


def test_llama_presets_have_llama3_sizes(compose_config):
    """Llama 3 8B and 70B as published (an untied head over a 128,256-token vocabulary)."""
    from megatier.model.params import count_parameters

    for model, size in {"llama3_8b": 8.03e9, "llama3_70b": 70.55e9}.items():
        cfg = compose_config(f"model={model}")
        assert abs(count_parameters(cfg.model, cfg.model.vocab_size) - size) / size < 0.001, model


def test_tp_must_divide_the_key_value_heads(compose_config):
    """Grouped-query attention splits the kv heads over tp: 4 query heads would divide, 2 kv groups do not."""
    cfg = compose_config("model=llama_tiny", "parallel.tp=4")
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=4)
    message = str(err.value)
    assert "\n" not in message and "parallel.tp=4" in message and "model.num_query_groups=2" in message, message
    validate(compose_config("model=llama_tiny", "parallel.tp=2"), world_size=2)


def test_unknown_key_is_rejected(compose_config):
    with pytest.raises(ConfigCompositionException):
        compose_config("model.num_hedas=4")


@pytest.mark.parametrize(
    "overrides, fields",
    [
        (["model.num_heads=5"], ["model.num_heads=5", "model.hidden_size=64"]),
        (["data.seq_len=512"], ["data.seq_len=512", "model.max_position_embeddings"]),
        (["train.global_batch_size=5"], ["train.global_batch_size=5", "train.micro_batch_size"]),
        (["train.precision=fp8"], ["train.precision"]),
        (["optim.min_lr=1.0"], ["optim.min_lr"]),
        (["optim.decay_style=WSD"], ["optim.decay_style='WSD'", "wsd"]),
        (["optim.decay_style=wsd"], ["optim.decay_style=wsd", "optim.wsd_decay_iters"]),
        (["optim.decay_style=wsd", "optim.wsd_decay_iters=20", "optim.decay_iters=10"],
         ["optim.wsd_decay_iters=20", "optim.decay_iters=10"]),
        (["optim.wsd_decay_style=step"], ["optim.wsd_decay_style='step'", "minus_sqrt"]),
        (["optim.warmup_fraction=0.1"], ["optim.warmup_iters=10", "set optim.warmup_iters=0"]),
        (["optim.warmup_fraction=1.5", "optim.warmup_iters=0"], ["optim.warmup_fraction=1.5"]),
        (["optim.warmup_init_lr=1.0"], ["optim.warmup_init_lr=1.0", "optim.lr"]),
        (["train.rampup_batch_size=[4,4]"], ["train.rampup_batch_size=[4, 4]", "three positive integers"]),
        (["train.rampup_batch_size=[8,4,100]"], ["start below train.global_batch_size=8"]),
        (["train.rampup_batch_size=[4,3,100]"], ["whole increments of 3"]),
        (["train.rampup_batch_size=[2,2,100]"], ["multiples of train.micro_batch_size x dp=4"]),
        (["parallel.tp=3"], ["parallel.tp=3"]),
        (["data.prefix=/nonexistent/data"], ["data.prefix", "megatier-preprocess"]),
        (["logging.wandb.mode=sometimes"], ["logging.wandb.mode"]),
        (["reliability.on_nonfinite=ignore"], ["reliability.on_nonfinite='ignore'", "stop or skip_step"]),
        (["train.precision=fp16", "reliability.max_consecutive_skips=10"],
         ["reliability.max_consecutive_skips=10", "(32 skipped steps)", "at least 32"]),
    ],
)
def test_validation_names_fields(compose_config, overrides, fields):
    cfg = compose_config("model=tiny", *overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    message = str(err.value)
    assert "\n" not in message
    for field in fields:
        assert field in message


def test_world_size_must_fit_layout(compose_config):
    cfg = compose_config("model=tiny", "parallel.tp=2", "parallel.pp=2")
    with pytest.raises(ConfigError, match="world size 6"):
        validate(cfg, world_size=6)
    validate(cfg, world_size=8)


@pytest.mark.parametrize("overrides, world, fields", [
    (["parallel.tp=8"], 8, ["parallel.tp=8", "model.num_heads=4"]),  # heads not divisible by tp
    (["parallel.pp=3"], 3, ["parallel.pp=3", "model.num_layers=2"]),  # fewer layers than stages
    (["train.global_batch_size=4", "train.micro_batch_size=2"], 3, ["train.global_batch_size=4"]),  # dp=3
])
def test_a_relaunch_on_a_layout_that_cannot_hold_the_job_is_named(compose_config, overrides, world, fields):
    """Resharding restores onto any layout, but only onto one that can hold the model and its batch."""
    cfg = compose_config("model=tiny", *overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=world)
    assert "\n" not in str(err.value) and all(f in str(err.value) for f in fields), str(err.value)


def test_cli_bad_override_gives_one_line_reason(tmp_path):
    result = subprocess.run(
        [sys.executable, "pretrain_gpt.py", "model=tiny", "model.num_heads=5", f"logging.run_dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert errors == [
        "config error: model.num_heads=5 does not divide model.hidden_size=64; choose a head count that divides it"
    ]


def test_split_overrides_takes_what_follows_the_first_double_dash():
    from megatier.config import split_overrides

    argv = ["--nodes", "2", "--", "model=tiny", "--", "x"]
    assert split_overrides(argv) == (["--nodes", "2"], ["model=tiny", "--", "x"])
    assert split_overrides(["--nodes", "2"]) == (["--nodes", "2"], [])
    assert split_overrides(["--"]) == ([], [])


@pytest.mark.parametrize("override,message", [
    ("recovery.mode=restart", r"^recovery\.mode='restart' must be inprocess or relaunch$"),
    ("recovery.store=hostonly", r"^recovery\.store='hostonly' must be host:port"),
    ("recovery.wait_for_replacement_s=-1", r"^recovery\.wait_for_replacement_s=-1\.0 must be >= 0$"),
    ("recovery.round_timeout_s=0", r"^recovery\.round_timeout_s=0\.0 must be positive$"),
])
def test_recovery_settings_are_checked(compose_config, override, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_config(override))
