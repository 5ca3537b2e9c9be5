"""GPT-2 model shapes, parameter count, layout-independent initialisation, and vocabulary padding."""
from __future__ import annotations

import pytest
import torch

from megatier.config import ModelConfig
from megatier.model.gpt import GPTStage, init_weights, load_full_state
from megatier.model.params import StageSpec, canonical_shapes, count_parameters, padded_vocab_size, stage_layers

VOCAB = 257  # the byte tokenizer's; padded to 384 rows at tp=1


def _model(process_group, **kw):
    cfg = ModelConfig(num_layers=3, hidden_size=32, num_heads=4, max_position_embeddings=16, **kw)
    model = GPTStage(cfg, VOCAB, StageSpec(range(3), True, True), tp_group=process_group.tp_group,
                     dropout_generator=torch.Generator())
    init_weights(model, seed=5)
    return cfg, VOCAB, model


def test_shapes(process_group):
    cfg, vocab, model = _model(process_group)
    tokens = torch.randint(0, 257, (2, 16))
    assert model.padded_vocab_size == 384 and model.word.weight.shape == (384, 32)
    assert model(tokens).shape == (2, 16, 384)
    loss = model(tokens, tokens)
    assert loss.shape == (2, 16) and torch.isfinite(loss).all()
    # an untrained model is close to uniform over the true vocabulary
    assert abs(loss.mean().item() - torch.log(torch.tensor(float(vocab))).item()) < 0.5


def test_parameter_count_and_tied_head(process_group):
    cfg, vocab, model = _model(process_group)
    padding = (model.padded_vocab_size - vocab) * cfg.hidden_size
    assert sum(p.numel() for p in model.parameters()) == count_parameters(cfg, vocab) + padding
    assert model.output_weight is model.word.weight


def test_full_shapes_are_the_canonical_shapes(process_group):
    cfg, vocab, model = _model(process_group)
    assert {n: p.full_shape for n, p in model.named_parameters()} == canonical_shapes(cfg, vocab)
    assert model.word.weight.full_shape == (257, 32)
    assert model.layers["1"].attn.qkv.weight.full_shape == (96, 32)


def test_padded_logits_are_minus_inf_and_padded_rows_get_no_gradient(process_group):
    _, vocab, model = _model(process_group)
    with torch.no_grad():  # padded rows start at zero; make them large so a leak would show
        assert not model.word.weight[vocab:].any()
        model.word.weight[vocab:] = 100.0
    tokens = torch.randint(0, vocab, (2, 16))
    logits = model(tokens)
    assert torch.isneginf(logits[..., vocab:]).all() and torch.isfinite(logits[..., :vocab]).all()
    loss = model(tokens, tokens).mean()
    loss.backward()
    grad = model.word.weight.grad
    assert torch.isfinite(grad).all() and not grad[vocab:].any() and grad[:vocab].abs().sum() > 0
    reference = torch.nn.functional.cross_entropy(logits[..., :vocab].flatten(0, 1), tokens.flatten())
    torch.testing.assert_close(loss, reference, rtol=1e-6, atol=0.0)


def test_load_full_state_sets_slices_and_refuses_wrong_shapes(process_group):
    cfg, vocab, model = _model(process_group)
    state = {n: torch.randn(s) for n, s in canonical_shapes(cfg, vocab).items()}
    load_full_state(model, state)
    assert torch.equal(model.word.weight[:vocab], state["word.weight"]) and not model.word.weight[vocab:].any()
    assert torch.equal(model.layers["2"].mlp.fc.weight, state["layers.2.mlp.fc.weight"])
    state["pos.weight"] = torch.zeros(8, 32)
    with pytest.raises(ValueError, match=r"pos.weight: got a tensor of shape \(8, 32\), the model needs \(16, 32\)"):
        load_full_state(model, state)


def test_causal(process_group):
    _, _, model = _model(process_group)
    model.eval()
    a = torch.randint(0, 257, (1, 16))
    b = a.clone()
    b[0, 10:] = (b[0, 10:] + 1) % 257
    torch.testing.assert_close(model(a)[0, :10], model(b)[0, :10])


def test_init_is_seeded_by_name(process_group):
    _, _, a = _model(process_group)
    _, _, b = _model(process_group)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name
    std = a.layers["0"].mlp.fc.weight.std().item()
    assert 0.015 < std < 0.025


def test_stage_layers_rule():
    assert [list(stage_layers(10, 4, r)) for r in range(4)] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert [len(stage_layers(8, 2, r)) for r in range(2)] == [4, 4]


def test_padded_vocab():
    assert padded_vocab_size(257, 128, 1) == 384
    assert padded_vocab_size(257, 128, 2) == 512
    assert padded_vocab_size(50257, 128, 1) == 50304
