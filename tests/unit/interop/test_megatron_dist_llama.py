"""Llama-shaped jobs, dense and Mixtral-shaped MoE, through Megatron-core's torch_dist: the round trip is bitwise
and megatron-core's dist_checkpointing.load reads the export into a MoE GPTModel built on CPU (local spec,
SequentialMLP experts, the allgather dispatcher: the alltoall one asks for a CUDA stream)."""
from __future__ import annotations

import os

import pytest
import torch

from megatier.config import ModelConfig, OptimConfig
from megatier.config.schema import MoEConfig
from megatier.interop.job_state import JobFormatError, JobState
from megatier.interop.megatron_dist import export_megatron_dist, load_megatron_dist
from megatier.interop.torchtitan_dcp import read_dcp
from megatier.model.params import canonical_shapes
from tests.distributed.world import run_world

pytest.importorskip("megatron.core")

VOCAB = 250  # 256 rows in Megatron's padded vocabulary
SHAPE = dict(name="mx", arch="llama", num_layers=2, hidden_size=32, num_heads=4, num_query_groups=2,
             ffn_hidden_size=48, max_position_embeddings=32)
MOE = ModelConfig(**SHAPE, moe=MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=40))
DENSE = ModelConfig(**SHAPE)
QWEN2 = ModelConfig(**SHAPE, qkv_bias=True)  # Megatron's add_qkv_bias


def _job(m: ModelConfig, seed: int = 0) -> JobState:
    g = torch.Generator().manual_seed(seed)
    canonical = {n: {"master": torch.randn(s, generator=g), "exp_avg": torch.randn(s, generator=g),
                     "exp_avg_sq": torch.rand(s, generator=g)} for n, s in canonical_shapes(m, VOCAB).items()}
    return JobState(canonical, iteration=4, adam_steps=4, consumed_samples=32)


@pytest.mark.parametrize("m", [MOE, DENSE, QWEN2], ids=["moe", "dense", "qkv_bias"])
def test_llama_round_trip_is_bitwise(tmp_path, m):
    job = _job(m)
    where = export_megatron_dist(job, m, OptimConfig(), str(tmp_path / "a"), lr=1e-3, batch=8)
    back = load_megatron_dist(str(tmp_path / "a"), m, VOCAB, OptimConfig())
    assert back.canonical.keys() == job.canonical.keys() and (back.iteration, back.adam_steps) == (4, 4)
    for name, kinds in job.canonical.items():
        assert all(torch.equal(back.canonical[name][k], v) for k, v in kinds.items()), name
    again = export_megatron_dist(back, m, OptimConfig(), str(tmp_path / "b"), lr=1e-3, batch=8)
    a, b = read_dcp(where), read_dcp(again)
    assert a.keys() == b.keys() and all(torch.equal(v, b[k]) for k, v in a.items())
    assert ("decoder.layers.self_attention.linear_qkv.bias" in a) == m.qkv_bias
    if m.moe.num_experts:
        experts = a["decoder.layers.mlp.experts.experts.linear_fc1.weight"]
        assert experts.shape == (2, 4, 80, 32)  # layer, global expert index, gate then up rows, hidden
        assert torch.equal(experts[1, 3], job.canonical["layers.1.moe.experts.3.gate_up.weight"]["master"])


def test_what_torch_dist_cannot_carry_is_refused_by_key(tmp_path):
    export_megatron_dist(_job(MOE), MOE, OptimConfig(), str(tmp_path), lr=1e-3, batch=8)
    with pytest.raises(JobFormatError, match="mlp.experts.experts.linear_fc1.weight"):
        load_megatron_dist(str(tmp_path), DENSE, VOCAB)
    export_megatron_dist(_job(QWEN2), QWEN2, OptimConfig(), str(tmp_path / "q"), lr=1e-3, batch=8)
    with pytest.raises(JobFormatError, match="linear_qkv.bias .* model.qkv_bias=false must match"):
        load_megatron_dist(str(tmp_path / "q"), DENSE, VOCAB)
    shared = ModelConfig(**SHAPE, moe=MoEConfig(num_experts=4, shared_expert_hidden_size=16))
    with pytest.raises(JobFormatError, match="model.moe.shared_expert_hidden_size"):
        export_megatron_dist(_job(shared), shared, OptimConfig(), str(tmp_path / "s"), lr=1e-3, batch=8)


def _mcore_load(rank: int, where: str, experts: int = 4, qkv_bias: bool = False) -> dict:
    import torch.nn.functional as F
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    mpu.initialize_model_parallel(1, 1)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=48, use_cpu_initialization=True, normalization="RMSNorm",
                            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                            add_qkv_bias=qkv_bias, num_moe_experts=experts or None, moe_router_topk=2,
                            moe_ffn_hidden_size=40 if experts else None, moe_token_dispatcher_type="allgather")
    spec = get_gpt_layer_local_spec(num_experts=experts or None, moe_grouped_gemm=False, normalization="RMSNorm")
    model = GPTModel(cfg, spec, vocab_size=256, max_sequence_length=32, position_embedding_type="rope",
                     share_embeddings_and_output_weights=False)
    sharded = {k: v for k, v in model.sharded_state_dict().items() if not isinstance(v, ShardedObject)}  # _extra_state
    loaded = dist_checkpointing.load(sharded, where, strict="assume_ok_unexpected")
    missing, _ = model.load_state_dict(loaded, strict=False)
    mpu.destroy_model_parallel()
    return {"missing": [k for k in missing if "_extra_state" not in k],
            "state": {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}}


@pytest.mark.timeout(120)
def test_megatron_core_loads_a_moe_export(tmp_path):
    job = _job(MOE, 1)
    where = export_megatron_dist(job, MOE, OptimConfig(), str(tmp_path / "save"), lr=1e-3, batch=8)
    got = run_world(_mcore_load, 1, tmp_path, where, timeout_s=90)[0]
    state, c = got["state"], job.canonical
    assert got["missing"] == [] and len(state) == 3 + 2 * (5 + 2 * 4)
    assert torch.equal(state["decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight"],
                       c["layers.1.moe.experts.2.gate_up.weight"]["master"])
    assert torch.equal(state["decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"],
                       c["layers.0.moe.experts.3.proj.weight"]["master"])
    assert torch.equal(state["decoder.layers.1.mlp.router.weight"], c["layers.1.moe.router.weight"]["master"])
    assert torch.equal(state["decoder.layers.0.pre_mlp_layernorm.weight"], c["layers.0.ln2.weight"]["master"])
    assert torch.equal(state["output_layer.weight"][:VOCAB], c["head_weight"]["master"])
    qkv = state["decoder.layers.0.self_attention.linear_qkv.weight"].view(2, 4, 8, 32)  # group: 2 q heads, k, v
    q, kv = c["layers.0.attn.q.weight"]["master"].view(4, 8, 32), c["layers.0.attn.kv.weight"]["master"]
    assert torch.equal(qkv[1, :2], q[2:]) and torch.equal(qkv[1, 2], kv.view(4, 8, 32)[1])
    assert torch.equal(qkv[0, 3], kv.view(4, 8, 32)[2])  # group 0's value: the first value head
    assert os.path.isfile(os.path.join(where, "common.pt"))


@pytest.mark.timeout(120)
def test_megatron_core_loads_q_k_v_biases_into_add_qkv_bias(tmp_path):
    job = _job(QWEN2, 2)
    where = export_megatron_dist(job, QWEN2, OptimConfig(), str(tmp_path / "save"), lr=1e-3, batch=8)
    got = run_world(_mcore_load, 1, tmp_path, where, 0, True, timeout_s=90)[0]
    assert got["missing"] == []
    bias = got["state"]["decoder.layers.1.self_attention.linear_qkv.bias"].view(2, 4, 8)  # group: 2 q heads, k, v
    q, kv = (job.canonical[f"layers.1.attn.{n}.bias"]["master"].view(-1, 8) for n in ("q", "kv"))
    assert torch.equal(bias[0, :2], q[:2]) and torch.equal(bias[1, :2], q[2:])
    assert torch.equal(bias[1, 2], kv[1]) and torch.equal(bias[1, 3], kv[3])  # group 1's key, then its value
