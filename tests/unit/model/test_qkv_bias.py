"""model.qkv_bias: config errors that name the field and the fix, a fingerprint that jobs written before the key
existed still match, and the biases' canonical names and tensor-parallel cut (q's as q's rows, k-then-v's with
kv's stride 2)."""
from __future__ import annotations

import pytest
import torch

from megatier.config import ConfigError, validate
from megatier.config.fingerprint import state_fingerprint
from megatier.model.params import canonical_shapes, tp_split
from megatier.slicing import full_from_shards, shard_of_full


@pytest.mark.parametrize("overrides,named", [
    (("model=tiny", "model.qkv_bias=true"), "model.qkv_bias=true is for model.arch=llama"),
    (("model=llama_tiny", "model.qkv_bias=true", "model.impl=te"), "Llama block has no biases; set model.impl=native"),
])
def test_qkv_bias_errors_name_the_field_and_the_fix(compose_config, overrides, named):
    with pytest.raises(ConfigError, match=named):
        validate(compose_config(*overrides))


def test_a_job_without_qkv_bias_keeps_its_fingerprint_and_one_with_it_records_it(compose_config):
    plain = state_fingerprint(compose_config("model=llama_tiny"), "x")
    biased = state_fingerprint(compose_config("model=llama_tiny", "model.qkv_bias=true"), "x")
    assert "model.qkv_bias" not in plain and biased["model.qkv_bias"] == "true"


def test_q_and_kv_biases_are_named_and_cut_as_their_weights_rows(compose_config):
    cfg = compose_config("model=llama_tiny", "model.qkv_bias=true").model
    shapes = canonical_shapes(cfg, 257)
    groups, hd = cfg.num_query_groups or cfg.num_heads, cfg.hidden_size // cfg.num_heads
    assert shapes["layers.1.attn.q.bias"] == (cfg.num_heads * hd,)
    assert shapes["layers.1.attn.kv.bias"] == (2 * groups * hd,)
    assert tp_split("layers.1.attn.q.bias") == (0, 1) and tp_split("layers.1.attn.kv.bias") == (0, 2)
    kv = torch.arange(2 * groups * hd, dtype=torch.float32)  # k rows, then v rows
    shards = [shard_of_full(kv, 0, 2, rank, 2) for rank in range(2)]
    assert torch.equal(shards[0], torch.cat([kv[:groups * hd // 2], kv[groups * hd:groups * hd * 3 // 2]]))
    assert torch.equal(full_from_shards(shards, 0, 2), kv)


def test_torchtitan_refuses_the_biases_it_would_drop(compose_config, tmp_path):
    """torchtitan's Llama has no q/k/v biases (torch_dist carries them: test_megatron_dist_llama.py)."""
    from megatier.interop.job_state import JobFormatError
    from megatier.interop.torchtitan_dcp import export_torchtitan

    cfg = compose_config("model=llama_tiny", "model.qkv_bias=true")
    with pytest.raises(JobFormatError, match="model.qkv_bias=true: MegaTier's torchtitan mapping has no q/k/v bias"):
        export_torchtitan(None, cfg.model, cfg.optim, str(tmp_path), 1e-3)
    assert list(tmp_path.iterdir()) == []  # refused before anything is written
