"""model.impl=te keeps the native model's parameters (names, order, shapes, tp splits) and function, on a CPU
stand-in of Transformer Engine (fake_te.py); the real layers against the native ones are tests/gpu/model."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatier.config import ModelConfig
from megatier.model.gpt import GPTStage, init_weights
from megatier.model.params import StageSpec, stage_parameters
from megatier.optim.flat import FlatLayout, flatten_parameters
from megatier.optim.grad_buffer import GradBuffer
from tests.unit.model import fake_te

CFG = dict(num_layers=3, hidden_size=32, num_heads=4, max_position_embeddings=16, ffn_hidden_size=48)
# Grouped-query attention: 8 query heads reading 4 key/value heads, so tp up to 4 keeps whole groups per rank.
LLAMA = dict(CFG, arch="llama", num_heads=8, num_query_groups=4)
ARCHS = {"gpt2": CFG, "llama": LLAMA}
VOCAB = 257


@pytest.fixture
def te(monkeypatch):
    return fake_te.install(monkeypatch)


def _stage(group, impl: str, spec=StageSpec(range(3), True, True), arch="gpt2", **kw) -> GPTStage:
    model = GPTStage(ModelConfig(impl=impl, **ARCHS[arch]), VOCAB, spec, tp_group=group,
                     dropout_generator=torch.Generator(), **kw)
    init_weights(model, seed=5)
    return model


def _described(model: GPTStage) -> list[tuple]:
    return [(n, tuple(p.shape), p.tp_partition_dim, p.tp_partition_stride, p.full_shape, p.copy_of,
             getattr(p, "expert_index", -1)) for n, p in model.named_parameters()]


def test_te_blocks_have_the_native_parameters_and_values(te, process_group):
    native, fused = _stage(process_group.tp_group, "native"), _stage(process_group.tp_group, "te")
    assert _described(fused) == _described(native)
    assert all(torch.equal(a, b) for a, b in zip(fused.parameters(), native.parameters()))  # canonical init
    block = fused.layers["1"]
    assert not list(block.ln_qkv.parameters()) and not list(block.ln_mlp.parameters())  # moved, not duplicated
    assert [n for n, _ in fused.named_parameters(remove_duplicate=False)] == [n for n, _ in fused.named_parameters()]
    # The TE layers compute with the holders' Parameter objects.
    assert block.ln_qkv.layer_norm_weight is block.ln1.weight and block.ln_qkv.weight is block.attn.qkv.weight
    assert block.attn_out.weight is block.attn.proj.weight and block.ln_mlp.fc2_bias is block.mlp.proj.bias
    assert block.ln_mlp.layer_norm_bias is block.ln2.bias and block.ln_mlp.fc1_weight is block.mlp.fc.weight


def test_te_llama_blocks_have_the_native_parameters_and_values(te, process_group):
    native = _stage(process_group.tp_group, "native", arch="llama")
    fused = _stage(process_group.tp_group, "te", arch="llama")
    assert _described(fused) == _described(native)
    assert all(torch.equal(a, b) for a, b in zip(fused.parameters(), native.parameters()))
    block = fused.layers["1"]
    assert not list(block.ln_qkv.parameters()) and not list(block.ln_mlp.parameters())
    assert block.ln_qkv.layer_norm_bias is None and block.ln_mlp.layer_norm_bias is None  # RMSNorm
    # parameters_split: this rank's q rows and k-then-v rows are the native attn.q and attn.kv.
    assert block.ln_qkv.q_weight is block.attn.q.weight and block.ln_qkv.kv_weight is block.attn.kv.weight
    assert block.ln_qkv.layer_norm_weight is block.ln1.weight and block.attn_out.weight is block.attn.proj.weight
    assert block.ln_mlp.fc1_weight is block.mlp.gate_up.weight and block.ln_mlp.fc2_weight is block.mlp.proj.weight


@pytest.mark.parametrize("tp,tp_rank", [(1, 0), (2, 1), (4, 3)])
@pytest.mark.parametrize("layers,first,last", [(range(3), True, True), (range(1, 2), False, False),
                                               (range(2, 3), False, True)])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_te_stages_are_described_by_stage_parameters(te, tp, tp_rank, layers, first, last, arch):
    """Per-rank shapes and splits under tp (the fake backend: no traffic), as the size planner and the segment
    table see them."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    spec = StageSpec(layers, first, last, tp_rank=tp_rank, tp=tp)
    dist.init_process_group("fake", store=FakeStore(), rank=tp_rank, world_size=tp)
    try:
        cfg = ModelConfig(impl="te", **ARCHS[arch])
        model = GPTStage(cfg, VOCAB, spec, tp_group=dist.group.WORLD, dropout_generator=torch.Generator())
        assert [tuple(p) for p in stage_parameters(cfg, VOCAB, spec)] == _described(model)
    finally:
        dist.destroy_process_group()


def _step(model: GPTStage, group, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss and the fp32 gradient buffer of one forward/backward, after the flat-buffer move the Trainer makes."""
    layout = FlatLayout.from_module(model, 1, tp_rank=0)
    flatten_parameters(model, layout, torch.float32, torch.device("cpu"))
    grads = GradBuffer(model, layout, torch.device("cpu"), dp_group=group)
    loss = model(tokens, tokens.roll(-1, 1)).mean()
    loss.backward()
    return loss.detach(), grads.flat


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_te_blocks_compute_the_native_function_and_gradients(te, process_group, arch):
    group = process_group.tp_group
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    native = _stage(group, "native", arch=arch)
    with torch.no_grad():  # norms away from 1, so a norm weight used in the wrong place shows
        for name, p in native.named_parameters():
            if "ln" in name and name.endswith("weight"):
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.2)
    fused = _stage(group, "te", arch=arch)
    fused.load_state_dict(native.state_dict())
    native_loss, native_grads = _step(native, group, tokens)
    te_loss, te_grads = _step(fused, group, tokens)
    torch.testing.assert_close(te_loss, native_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(te_grads, native_grads, rtol=1e-5, atol=1e-7)
    assert te_grads.abs().sum() > 0
    # After flatten_parameters the TE layers read the flat buffer: a change there changes their output.
    with torch.no_grad():
        fused.layers["0"].mlp.proj.weight.add_(1.0)
        assert not torch.equal(fused(tokens, tokens).mean(), te_loss)
    assert te.state["fp8_recipes"] and set(map(type, te.state["fp8_recipes"])) == {type(None)}  # no fp8 asked


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_fp8_runs_the_te_layers_under_a_delayed_scaling_autocast(te, process_group, arch):
    model = _stage(process_group.tp_group, "te", fp8=True, arch=arch)
    model(torch.randint(0, VOCAB, (2, 16)))
    recipes = te.state["fp8_recipes"]
    assert len(recipes) == 3 * 3  # three TE layers per block, three blocks
    recipe = recipes[0]
    assert all(r is recipe for r in recipes) and isinstance(recipe, fake_te.DelayedScaling)
    assert recipe.fp8_format == fake_te.Format.HYBRID and recipe.reduce_amax is False
    assert te.state["recipe"] is None  # the autocast ends with the layers
    with pytest.raises(ValueError, match="needs model.impl=te"):
        _stage(process_group.tp_group, "native", fp8=True)
