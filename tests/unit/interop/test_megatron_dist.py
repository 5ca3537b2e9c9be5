"""Megatron-core torch_dist checkpoints <-> a MegaTier job state; megatron-core's own dist_checkpointing.load
reads the export into a GPTModel built on CPU.

megatron-core 0.16 builds a GPTModel on CPU (use_cpu_initialization) and loads on gloo, but its torch_dist
save strategy and its attention's forward call CUDA, so here the reference writes nothing and runs no step:
the source checkpoints are written with PyTorch DCP under the ShardedTensor keys and global shapes the GPTModel
reports (the names below are asserted against its sharded_state_dict)."""
from __future__ import annotations

import os
from functools import partial

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from megatier.config import ModelConfig, OptimConfig
from megatier.interop.job_state import JobFormatError, JobState
from megatier.interop.megatron_dist import export_megatron_dist, load_megatron_dist
from megatier.interop.torchtitan_dcp import read_dcp
from megatier.model.params import canonical_shapes
from tests.distributed.world import run_world

pytest.importorskip("megatron.core")

VOCAB = 250  # padded to 256 rows by Megatron's make_vocab_size_divisible_by=128
MODEL = ModelConfig(name="mc", num_layers=2, hidden_size=32, num_heads=4, max_position_embeddings=32)
OPTIM = OptimConfig()


def _job(seed: int = 0) -> JobState:
    g = torch.Generator().manual_seed(seed)
    canonical = {n: {"master": torch.randn(s, generator=g), "exp_avg": torch.randn(s, generator=g),
                     "exp_avg_sq": torch.rand(s, generator=g)} for n, s in canonical_shapes(MODEL, VOCAB).items()}
    return JobState(canonical, iteration=7, adam_steps=6, consumed_samples=7 * 8)


def _mcore_load(rank: int, where: str) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    mpu.initialize_model_parallel(1, 1)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            activation_func=partial(torch.nn.functional.gelu, approximate="tanh"))
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=256, max_sequence_length=32,
                     position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True)
    sharded = {k: v for k, v in model.sharded_state_dict().items() if isinstance(v, ShardedTensor)}
    keys = {v.key: tuple(v.global_shape) for v in sharded.values()}
    loaded = dist_checkpointing.load(sharded, where, strict="assume_ok_unexpected")
    model.load_state_dict(loaded, strict=False)
    mpu.destroy_model_parallel()
    return {"keys": keys, "state": {k: v.detach().clone() for k, v in model.state_dict().items()
                                    if isinstance(v, torch.Tensor)}}


def test_round_trip_is_bitwise(tmp_path):
    job = _job()
    where = export_megatron_dist(job, MODEL, OPTIM, str(tmp_path), lr=1e-3, batch=8)
    back = load_megatron_dist(str(tmp_path), MODEL, VOCAB, OPTIM)  # through latest_checkpointed_iteration.txt
    assert where.endswith("iter_0000007") and (back.iteration, back.adam_steps, back.consumed_samples) == (7, 6, 56)
    for name, kinds in job.canonical.items():
        for kind, value in kinds.items():
            assert torch.equal(back.canonical[name][kind], value), (name, kind)


@pytest.mark.timeout(120)
def test_megatron_core_loads_the_export_into_a_gptmodel(tmp_path):
    job = _job(1)
    where = export_megatron_dist(job, MODEL, OPTIM, str(tmp_path / "save"), lr=1e-3, batch=8)
    got = run_world(_mcore_load, 1, tmp_path, where, timeout_s=90)[0]
    flat = read_dcp(where)
    assert all(tuple(flat[k].shape) == shape for k, shape in got["keys"].items())  # every GPTModel key, its shape
    state = got["state"]
    assert torch.equal(state["embedding.word_embeddings.weight"][:VOCAB], job.canonical["word.weight"]["master"])
    assert not state["embedding.word_embeddings.weight"][VOCAB:].any()
    assert torch.equal(state["decoder.layers.1.mlp.linear_fc2.weight"],
                       job.canonical["layers.1.mlp.proj.weight"]["master"])
    assert torch.equal(state["decoder.layers.0.input_layernorm.weight"],
                       job.canonical["layers.0.ln1.weight"]["master"])
    qkv = state["decoder.layers.0.self_attention.linear_qkv.weight"].view(4, 3, 8, 32)  # per head: q, k, v
    ours = job.canonical["layers.0.attn.qkv.weight"]["master"].view(3, 4, 8, 32)
    assert torch.equal(qkv[2, 1], ours[1, 2])  # head 2's key rows


def test_a_key_megatier_lacks_is_refused_by_name(tmp_path):
    where = export_megatron_dist(_job(), MODEL, OPTIM, str(tmp_path), lr=1e-3, batch=8)
    flat = {k: v for k, v in read_dcp(where).items()}
    flat["decoder.layers.self_attention.q_layernorm.weight"] = torch.ones(2, 8)
    odd = tmp_path / "odd"
    dcp.save(flat, checkpoint_id=str(odd), no_dist=True)
    for name in ("common.pt", "metadata.json"):
        os.link(os.path.join(where, name), odd / name)
    with pytest.raises(JobFormatError, match="q_layernorm"):
        load_megatron_dist(str(odd), MODEL, VOCAB, OPTIM)
    with pytest.raises(JobFormatError, match=r"Llama cannot represent decoder\.final_layernorm\.bias"):
        load_megatron_dist(where, ModelConfig(name="l", arch="llama"), VOCAB, OPTIM)  # a GPT-2 checkpoint


def test_megatron_to_megatier_to_megatron_is_bitwise(tmp_path):
    source = export_megatron_dist(_job(2), MODEL, OPTIM, str(tmp_path / "src"), lr=1e-3, batch=8)
    again = export_megatron_dist(load_megatron_dist(source, MODEL, VOCAB, OPTIM), MODEL, OPTIM,
                                 str(tmp_path / "again"), lr=1e-3, batch=8)
    a, b = read_dcp(source), read_dcp(again)
    assert a.keys() == b.keys() and len(a) == 16 * 4  # 16 stacked model keys; fp32_param, exp_avg, exp_avg_sq of each
    for key, value in a.items():
        assert torch.equal(value, b[key]), key
    common = [torch.load(os.path.join(w, "common.pt"), weights_only=False) for w in (source, again)]
    assert common[0] == common[1]


def _mcore_optimizer_asks(rank: int) -> dict:
    """What megatron-core's DistributedOptimizer would ask of a torch_dist checkpoint for a GPTModel: its
    sharded_param_state_fs_model_space keys (optimizer.state.<fp32_param|exp_avg|exp_avg_sq>.<model key>, the
    model ShardedTensor's global shape, fp32), and the identifier keys by which load_state_dict matches each of
    _get_param_groups' groups to a checkpoint's group. The optimizer itself allocates CUDA tensors in its
    constructor, so it is not built here."""
    from megatron.core import parallel_state as mpu
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
    from megatron.core.optimizer import _get_param_groups
    from megatron.core.optimizer.optimizer import param_group_identifier_keys
    from megatron.core.transformer.transformer_config import TransformerConfig
    mpu.initialize_model_parallel(1, 1)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=256, max_sequence_length=32,
                     position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True)
    trainable = {p for p in model.parameters() if p.requires_grad}
    asks = {f"optimizer.state.{kind}.{sh.key}": tuple(sh.global_shape)
            for sh in model.sharded_state_dict().values()
            if isinstance(sh, ShardedTensor) and sh.data in trainable
            for kind in ("fp32_param", "exp_avg", "exp_avg_sq")}
    groups = _get_param_groups([model], McoreOptimizerConfig(optimizer="adam", lr=1e-3), None)
    needed = [tuple(g[k] for k in param_group_identifier_keys) for g in groups]
    mpu.destroy_model_parallel()
    return {"asks": asks, "needed": needed, "identifiers": param_group_identifier_keys}


@pytest.mark.timeout(120)
def test_the_export_holds_what_megatron_cores_distributed_optimizer_asks_for(tmp_path):
    where = export_megatron_dist(_job(3), MODEL, OPTIM, str(tmp_path / "save"), lr=1e-3, batch=8)
    got = run_world(_mcore_optimizer_asks, 1, tmp_path, timeout_s=90)[0]
    meta = FileSystemReader(where).read_metadata().state_dict_metadata
    assert len(got["asks"]) == 16 * 3
    for key, shape in got["asks"].items():
        assert tuple(meta[key].size) == shape and meta[key].properties.dtype == torch.float32, key
    common = torch.load(os.path.join(where, "common.pt"), weights_only=False)
    assert common["optimizer"]["param_state_sharding_type"] == "fully_sharded_model_space"
    ours = {tuple(g[k] for k in got["identifiers"]) for g in common["optimizer"]["optimizer"]["param_groups"]}
    assert len(got["needed"]) == 2 and set(got["needed"]) <= ours  # decay and no-decay groups both found
