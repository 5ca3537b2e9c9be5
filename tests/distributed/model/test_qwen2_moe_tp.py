"""A Qwen2-MoE imported from transformers (q/k/v biases, a gated shared expert, softmax-then-top-k routing, a
dense layer between MoE ones) at tp=2, with and without sequence parallelism: its logits equal
Qwen2MoeForCausalLM's, and its loss with the router loss and every gradient (the biases' too) equal tp=1's."""
from __future__ import annotations

import pytest
import torch

from megatier.interop.huggingface import load_hf
from megatier.model.gpt import load_full_state
from megatier.parallel.state import build_parallel_state
from tests.distributed.model.test_moe_tp import VOCAB, _full_grads, _logits, _loss_and_grads, _model, runs_by_layout
from tests.hf_qwen2_moe import save_random_qwen2_moe
from tests.unit.interop.test_qwen2_moe import QWEN

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(180)


def _run(rank: int, hf_dir: str, tp: int, sequence_parallel: bool, tokens: torch.Tensor) -> dict:
    ps = build_parallel_state(tp, 1, 60.0, torch.device("cpu"))
    model = _model(QWEN, ps, tp, sequence_parallel)
    load_full_state(model, load_hf(hf_dir, QWEN, VOCAB))
    logits = _logits(model, tokens[:, :-1], ps.tp_group)
    loss, grads = _loss_and_grads(model, tokens, ps.tp_group)
    return {"logits": logits, "loss": loss, "grads": grads}


def test_tp2_qwen2_moe_equals_transformers_and_tp1(tmp_path):
    expected, runs = runs_by_layout(_run, save_random_qwen2_moe(str(tmp_path / "hf"), QWEN, VOCAB), tmp_path)
    one, one_grads = runs[(1, False)][0], _full_grads(runs[(1, False)])
    assert any(name.endswith("attn.kv.bias") for name in one_grads)
    for layout, results in runs.items():
        worst = (results[0]["logits"] - expected).abs().max()
        print(f"tp={layout[0]} sp={layout[1]}: max logit difference from transformers' Qwen2-MoE {worst:.2e}")
        assert worst <= 1e-4, (layout, worst)
        assert results[0]["loss"] == pytest.approx(one["loss"], rel=1e-6), layout
        grads = _full_grads(results)
        for name in one_grads:
            torch.testing.assert_close(grads[name], one_grads[name], rtol=1e-5, atol=1e-7, msg=f"{layout} {name}")
