"""model.moe: presets with the published sizes (total and active parameters), config errors that name the field
and the fix, and a fingerprint that dense jobs written before model.moe existed still match."""
from __future__ import annotations

import pytest

from megatier.config import ConfigError, validate
from megatier.config.fingerprint import state_fingerprint
from megatier.model.params import canonical_shapes, count_active_parameters, count_parameters


@pytest.mark.parametrize("model,total,active", [("mixtral_8x7b", 46.70e9, 12.88e9),
                                                ("qwen_moe_a2_7b", 14.32e9, 2.69e9)])
def test_moe_presets_have_published_total_and_active_sizes(compose_config, model, total, active):
    cfg = compose_config(f"model={model}")
    validate(cfg)
    vocab = cfg.model.vocab_size
    assert abs(count_parameters(cfg.model, vocab) - total) / total < 0.001
    assert abs(count_active_parameters(cfg.model, vocab) - active) / active < 0.001


def test_tiny_moe_has_canonical_expert_names_and_layer_freq(compose_config):
    cfg = compose_config("model=tiny_moe", "data.seq_len=64")
    validate(cfg)
    names = canonical_shapes(cfg.model, 257)
    assert names["layers.1.moe.experts.3.gate_up.weight"] == (128, 64) and "layers.0.mlp.proj.weight" not in names
    every_other = canonical_shapes(compose_config("model=tiny_moe", "model.moe.layer_freq=2").model, 257)
    assert "layers.0.moe.router.weight" in every_other and "layers.1.mlp.gate_up.weight" in every_other


@pytest.mark.parametrize("overrides,named", [
    (("model.moe.top_k=5",), "model.moe.top_k=5"),
    (("model.moe.router_norm=sigmoid",), "model.moe.router_norm='sigmoid'"),
    (("model.moe.moe_ffn_hidden_size=63", "parallel.tp=2"), "model.moe.moe_ffn_hidden_size=63"),
    (("model.moe.layer_freq=0",), "model.moe.layer_freq=0"),
    (("model.arch=gpt2", "model.num_query_groups=null"), "model.arch=llama"),
    (("parallel.pp=2",), "model.moe.router_loss_scope=layer"),
    (("model.moe.router_loss_scope=sum",), "model.moe.router_loss_scope='sum'"),
])
def test_moe_errors_name_the_field_and_the_fix(compose_config, overrides, named):
    cfg = compose_config("model=tiny_moe", *overrides)
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")) as err:
        validate(cfg, world_size=cfg.parallel.tp * cfg.parallel.pp)
    assert "\n" not in str(err.value)


def test_pipeline_stages_take_the_router_losses_per_layer(compose_config):
    cfg = compose_config("model=tiny_moe", "parallel.pp=2", "model.moe.router_loss_scope=layer",
                         "model.moe.z_loss_coeff=0.001")
    validate(cfg, world_size=2)


def test_dense_fingerprint_has_no_moe_keys_and_an_moe_one_has_them(compose_config):
    assert not [k for k in state_fingerprint(compose_config("model=llama_tiny"), "") if ".moe." in k]
    moe = state_fingerprint(compose_config("model=tiny_moe"), "")
    assert moe["model.moe.num_experts"] == "4" and moe["model.moe.aux_loss_coeff"] == "0.02"


def test_an_export_rebuilds_the_moe_config_from_the_fingerprint(compose_config):
    from megatier.checkpoint.offline.state import run_configs

    cfg = compose_config("model=tiny_moe", "model.moe.z_loss_coeff=0.001")
    model, _ = run_configs(state_fingerprint(cfg, ""))
    assert model.moe == cfg.model.moe and model.num_layers == cfg.model.num_layers
    dense, _ = run_configs(state_fingerprint(compose_config("model=llama_tiny"), ""))
    assert dense.moe.num_experts == 0


@pytest.mark.parametrize("overrides,world,named", [
    (("parallel.ep=3",), 3, "model.moe.num_experts=4"),  # 3 does not divide 4 experts
    (("parallel.ep=4",), 2, "the data-parallel degree 2"),
    (("parallel.ep=2", "model=llama_tiny"), 2, "parallel.ep=1 or model.moe.num_experts > 0"),
    (("parallel.ep=0",), 1, "parallel.ep=0 must be >= 1"),
])
def test_expert_parallel_errors_name_the_field_and_the_fix(compose_config, overrides, world, named):
    cfg = compose_config("model=tiny_moe", *overrides)
    with pytest.raises(ConfigError, match=named) as err:
        validate(cfg, world_size=world)
    assert "parallel.ep=" in str(err.value) and "\n" not in str(err.value)


def test_ep2_validates_where_it_divides_dp_and_the_experts(compose_config):
    validate(compose_config("model=tiny_moe", "parallel.ep=2"), world_size=2)
