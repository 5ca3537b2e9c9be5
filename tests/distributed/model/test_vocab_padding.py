"""Vocabulary padding is storage only: the same real weights give the same loss under tp=1 and tp=2.

Both ranks of a 2-process world hold the model twice, from one canonical state:
at tp=1 (384 padded rows, whole model on each rank) and at tp=2 (512 padded
rows, half on each). The vocabulary of 259 ids leaves tp rank 1 three real
rows. Padded rows are then set to large values, different per layout, so any
padded logit that reached the softmax would move the loss.
"""
from __future__ import annotations

import pytest
import torch

from megatier.config import ModelConfig
from megatier.model.gpt import GPTStage, load_full_state
from megatier.model.params import StageSpec, canonical_shapes
from megatier.parallel.state import build_parallel_state
from megatier.slicing import full_from_shards
from tests.distributed.world import run_world

VOCAB = 259
CFG = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, max_position_embeddings=16)

pytestmark = pytest.mark.timeout(120)


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {n: torch.randn(s, generator=gen) * 0.3 for n, s in canonical_shapes(CFG, VOCAB).items()}


def _run(ps, fill: float) -> dict:
    spec = StageSpec(range(CFG.num_layers), True, True, ps.tp_rank, ps.tp)
    model = GPTStage(CFG, VOCAB, spec, tp_group=ps.tp_group, dropout_generator=torch.Generator())
    load_full_state(model, _state())
    model.eval()
    with torch.no_grad():
        first_padded = max(VOCAB - model.vocab_start, 0)  # local row of the first padded id
        model.word.weight[first_padded:] = fill
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    tokens[0, :3] = torch.tensor([VOCAB - 1, VOCAB - 2, VOCAB - 3])  # ids on tp rank 1's few real rows
    loss = model(tokens, tokens.roll(-1, dims=1))
    loss.mean().backward()
    return {"loss": loss.detach(), "grad": model.word.weight.grad.clone(), "logits": model(tokens).detach(),
            "first_padded": first_padded}


def _worker(rank: int) -> dict:
    tp2 = build_parallel_state(2, 1, 60.0, torch.device("cpu"))
    tp1 = build_parallel_state(1, 1, 60.0, torch.device("cpu"))  # tp=1, dp=2: the whole model on each rank
    return {"tp1": _run(tp1, fill=30.0), "tp2": _run(tp2, fill=-70.0)}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return run_world(_worker, 2, tmp_path_factory.mktemp("vocab"))


def test_same_real_weights_same_loss_under_tp1_and_tp2(results):
    for res in results:
        torch.testing.assert_close(res["tp2"]["loss"], res["tp1"]["loss"], rtol=1e-6, atol=0.0)


def test_padded_logits_are_minus_inf_on_every_tp_rank(results):
    for res in results:
        for run in (res["tp1"], res["tp2"]):
            logits, first = run["logits"], run["first_padded"]
            assert torch.isneginf(logits[..., first:]).all() and torch.isfinite(logits[..., :first]).all()


def test_padded_rows_get_exactly_zero_gradient(results):
    tp1 = results[0]["tp1"]["grad"]
    tp2 = full_from_shards([res["tp2"]["grad"] for res in results], 0)
    assert tp1.shape == (384, 32) and tp2.shape == (512, 32)
    assert not tp1[VOCAB:].any() and not tp2[VOCAB:].any()
    torch.testing.assert_close(tp2[:VOCAB], tp1[:VOCAB], rtol=1e-5, atol=1e-7)
