"""GPT-2 model shapes, parameter count, and layout-independent initialisation."""
from __future__ import annotations

import torch

from megatier.config import ModelConfig
from megatier.model.gpt import GPTStage, StageSpec, count_parameters, init_weights, padded_vocab_size, stage_layers


def _model(process_group, **kw):
    cfg = ModelConfig(num_layers=3, hidden_size=32, num_heads=4, max_position_embeddings=16, **kw)
    vocab = padded_vocab_size(257, 128, 1)
    model = GPTStage(cfg, vocab, StageSpec(range(3), True, True), tp_group=process_group.tp_group,
                     dropout_generator=torch.Generator())
    init_weights(model, seed=5)
    return cfg, vocab, model


def test_shapes(process_group):
    cfg, vocab, model = _model(process_group)
    tokens = torch.randint(0, 257, (2, 16))
    assert model(tokens).shape == (2, 16, vocab)
    loss = model(tokens, tokens)
    assert loss.shape == (2, 16) and torch.isfinite(loss).all()
    # an untrained model is close to uniform over the vocabulary
    assert abs(loss.mean().item() - torch.log(torch.tensor(float(vocab))).item()) < 0.5


def test_parameter_count_and_tied_head(process_group):
    cfg, vocab, model = _model(process_group)
    assert sum(p.numel() for p in model.parameters()) == count_parameters(cfg, vocab)
    assert model.output_weight is model.word.weight


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
