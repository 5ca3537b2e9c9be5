"""stage_parameters describes every stage exactly as GPTStage builds it, under any tp and pipeline position."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatier.config import ModelConfig
from megatier.model.gpt import GPTStage
from megatier.model.params import StageSpec, padded_vocab_size, stage_parameters
from megatier.optim.flat import FlatLayout

CFG = ModelConfig(num_layers=3, hidden_size=32, num_heads=4, max_position_embeddings=16, ffn_hidden_size=48)
LLAMA = ModelConfig(arch="llama", num_layers=3, hidden_size=32, num_heads=8, num_query_groups=4,
                    max_position_embeddings=16, ffn_hidden_size=48)
VOCAB = 257
STAGES = {"whole": (range(3), True, True), "first": (range(2), True, False), "middle": (range(1, 2), False, False),
          "last": (range(2, 3), False, True),
          # CheckFree+'s replicas: of the positions on stage 1, of the final LayerNorm on stage P-2
          "middle+pos": (range(1, 2), False, False, 0, 1, ("pos",)),
          "middle+final_norm": (range(1, 2), False, False, 0, 1, ("final_norm",))}


def _built(spec: StageSpec, cfg: ModelConfig = CFG) -> list[tuple]:
    """(name, shape, tp_dim, stride, full_shape, copy_of, expert_index) of a real GPTStage on tp ranks (the fake
    backend: no traffic)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=spec.tp_rank, world_size=spec.tp)
    try:
        with torch.device("meta"):
            model = GPTStage(cfg, VOCAB, spec, tp_group=dist.group.WORLD, dropout_generator=torch.Generator())
        return [(n, tuple(p.shape), p.tp_partition_dim, p.tp_partition_stride, p.full_shape, p.copy_of,
                 getattr(p, "expert_index", -1)) for n, p in model.named_parameters()], model
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp,tp_rank", [(1, 0), (2, 1), (4, 3)])
@pytest.mark.parametrize("stage", STAGES)
def test_stage_parameters_are_the_built_stages(stage, tp, tp_rank):
    layers, first, last, *rest = STAGES[stage]
    spec = StageSpec(layers, first, last, tp_rank=tp_rank, tp=tp, replicas=rest[2] if rest else ())
    built, model = _built(spec)
    assert [tuple(p) for p in stage_parameters(CFG, VOCAB, spec)] == built


@pytest.mark.parametrize("tp,tp_rank", [(1, 0), (2, 1), (4, 3)])
@pytest.mark.parametrize("stage", ["whole", "first", "middle", "last"])
@pytest.mark.parametrize("qkv_bias", [False, True])
def test_llama_stage_parameters_are_the_built_stages(stage, tp, tp_rank, qkv_bias):
    layers, first, last = STAGES[stage]
    spec = StageSpec(layers, first, last, tp_rank=tp_rank, tp=tp)
    cfg = ModelConfig(**{**LLAMA.__dict__, "qkv_bias": qkv_bias})
    built, _ = _built(spec, cfg)
    assert [tuple(p) for p in stage_parameters(cfg, VOCAB, spec)] == built
    assert (f"layers.{layers[0]}.attn.kv.bias" in [b[0] for b in built]) == qkv_bias
    names = [b[0] for b in built]
    assert ("head_weight" in names) == last and "pos.weight" not in names  # untied head, rotary positions
    assert all(b[5] == "" for b in built)  # no copies: the head is a parameter of its own


@pytest.mark.parametrize("tp,tp_rank", [(1, 0), (2, 1)])
@pytest.mark.parametrize("replicas", [("word",), ("final_norm", "head")])
def test_llama_checkfree_plus_replicas_are_described(replicas, tp, tp_rank):
    """CheckFree+ on Llama: stage 1 copies the word embedding, stage P-2 the final RMSNorm and the untied head,
    vocabulary rows cut over tp as their sources'."""
    spec = StageSpec(range(1, 2), False, False, tp_rank=tp_rank, tp=tp, replicas=replicas)
    built, _ = _built(spec, LLAMA)
    assert [tuple(p) for p in stage_parameters(LLAMA, VOCAB, spec)] == built
    copies = {b[0]: (b[1], b[2], b[4], b[5]) for b in built if b[5]}
    rows = padded_vocab_size(VOCAB, LLAMA.make_vocab_size_divisible_by, tp) // tp
    want = {"word": {"word_replica.weight": ((rows, 32), 0, (VOCAB, 32), "word.weight")},
            "final_norm": {"final_norm_replica.weight": ((32,), None, (32,), "final_norm.weight")},
            "head": {"head_replica.weight": ((rows, 32), 0, (VOCAB, 32), "head_weight")}}
    assert copies == {k: v for kind in replicas for k, v in want[kind].items()}


def test_the_flat_layout_of_described_parameters_is_the_modules():
    spec = StageSpec(range(2, 3), False, True, tp_rank=1, tp=2)
    _, model = _built(spec)
    for dp in (1, 3):
        from_module = FlatLayout.from_module(model, dp, tp_rank=1)
        described = FlatLayout.from_params(stage_parameters(CFG, VOCAB, spec), dp, tp_rank=1)
        assert described.segments == from_module.segments and described.shard_size == from_module.shard_size
