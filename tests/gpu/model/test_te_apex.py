"""Transformer Engine and NVIDIA apex layers against the native ones, on a GPU. Skipped without CUDA, Transformer
Engine or apex (each test says which).

Tolerances (the libraries run other kernels: other GEMM algorithms and reduction orders, TF32 where cuBLAS picks it
for fp32, fused LayerNorm and RMSNorm statistics); model.impl=te is checked for the GPT-2 and the Llama block:

    model.impl=te vs native, fp32      loss within 1e-3 relative; every gradient within 1e-2 of its largest entry
    model.impl=te vs native, bf16      loss within 2e-2 relative; every gradient within 5e-2 of its largest entry
    fp8 (te) vs native bf16            loss within 5e-2 relative; the whole gradient's cosine similarity > 0.98
    apex FusedLayerNorm vs LayerNorm   fp32: output 1e-5, input/weight/bias gradients 1e-4 (absolute + relative);
                                       bf16: 2e-2
    apex multi-tensor L2 norm          the squared norm within 1e-5 relative of the float64 one
"""
from __future__ import annotations

import pytest
import torch

from megatier import fastpaths
from megatier.config import ModelConfig
from megatier.model.gpt import GPTStage, init_weights
from megatier.model.params import StageSpec
from megatier.optim.grad_norm import local_sumsq

CUDA = fastpaths.cuda_missing()


def _needs(what: str, missing) -> pytest.MarkDecorator:
    """Skip unless there is a GPU and ``missing()`` finds nothing missing; the reason names the first gap."""
    reason = f"needs a GPU: {CUDA}" if CUDA is not None else None
    if reason is None and missing() is not None:
        reason = f"needs {what}: {missing()}"
    return pytest.mark.skipif(reason is not None, reason=reason or "")


needs_te = _needs("Transformer Engine", fastpaths.transformer_engine_missing)
needs_apex_ln = _needs("NVIDIA apex's FusedLayerNorm", fastpaths.apex_layernorm_missing)
needs_apex_norm = _needs("NVIDIA apex's multi-tensor kernels", fastpaths.apex_grad_norm_missing)

VOCAB = 257
# Every fp8 GEMM dimension a multiple of 16, tokens per micro-batch a multiple of 8.
CFG = dict(num_layers=2, hidden_size=64, num_heads=4, ffn_hidden_size=256, max_position_embeddings=64)
LLAMA = dict(arch="llama", num_query_groups=2)  # RMSNorm, rotary, grouped-query attention, SwiGLU (TELlamaBlock)


def _stage(group, dtype, fp8=False, **cfg) -> GPTStage:
    model = GPTStage(ModelConfig(**CFG, **cfg), VOCAB, StageSpec(range(2), True, True), tp_group=group,
                     dropout_generator=torch.Generator(device="cuda"), fp8=fp8)
    init_weights(model, seed=7)
    return model.to(device="cuda", dtype=dtype)


def _loss_and_grads(model: GPTStage, tokens: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    loss = model(tokens, tokens.roll(-1, 1)).float().mean()
    loss.backward()
    return loss.item(), {n: p.grad.float() for n, p in model.named_parameters()}


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(1)).cuda()


@needs_te
@pytest.mark.parametrize("arch", [{}, LLAMA], ids=["gpt2", "llama"])
@pytest.mark.parametrize("dtype,loss_rtol,grad_tol", [(torch.float32, 1e-3, 1e-2), (torch.bfloat16, 2e-2, 5e-2)])
def test_te_blocks_match_native(process_group, dtype, loss_rtol, grad_tol, arch):
    group = process_group.tp_group
    native_loss, native = _loss_and_grads(_stage(group, dtype, **arch), _tokens())
    te_loss, te = _loss_and_grads(_stage(group, dtype, impl="te", **arch), _tokens())
    assert te_loss == pytest.approx(native_loss, rel=loss_rtol)
    assert te.keys() == native.keys()
    for name, grad in native.items():
        assert (te[name] - grad).abs().max() <= grad_tol * grad.abs().max() + 1e-8, name


@needs_te
def test_fp8_trains_close_to_bf16(process_group):
    fp8 = fastpaths.fp8_missing()  # after Transformer Engine: it asks TE
    if fp8 is not None:
        pytest.skip(fp8)
    group = process_group.tp_group
    native_loss, native = _loss_and_grads(_stage(group, torch.bfloat16), _tokens())
    fp8_loss, low = _loss_and_grads(_stage(group, torch.bfloat16, fp8=True, impl="te"), _tokens())
    assert fp8_loss == pytest.approx(native_loss, rel=5e-2)
    a, b = torch.cat([g.flatten() for g in native.values()]), torch.cat([low[n].flatten() for n in native])
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.98


@needs_apex_ln
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_apex_layernorm_matches_torch(dtype, tol):
    from megatier.model.fused import fused_layer_norm

    native = torch.nn.LayerNorm(64, eps=1e-5).cuda().to(dtype)
    fused = fused_layer_norm(64, 1e-5).cuda().to(dtype)
    with torch.no_grad():
        for p, q in ((native.weight, fused.weight), (native.bias, fused.bias)):
            p.copy_(torch.randn(64) * 0.1 + (1.0 if p is native.weight else 0.0))
            q.copy_(p)
    x = torch.randn(8, 32, 64, device="cuda", dtype=dtype, requires_grad=True)
    y = x.detach().clone().requires_grad_(True)
    out_n, out_f = native(x), fused(y)
    torch.testing.assert_close(out_f, out_n, atol=tol, rtol=tol)
    grad = torch.randn_like(out_n)
    out_n.backward(grad)
    out_f.backward(grad)
    back_tol = 10 * tol if dtype == torch.float32 else tol
    for a, b in ((y.grad, x.grad), (fused.weight.grad, native.weight.grad), (fused.bias.grad, native.bias.grad)):
        torch.testing.assert_close(a, b, atol=back_tol, rtol=back_tol)


@needs_apex_ln
def test_a_model_on_apex_layernorm_matches_native(process_group):
    native_loss, _ = _loss_and_grads(_stage(process_group.tp_group, torch.float32), _tokens())
    apex_loss, _ = _loss_and_grads(_stage(process_group.tp_group, torch.float32, layernorm_impl="apex"), _tokens())
    assert apex_loss == pytest.approx(native_loss, rel=1e-5)


@needs_apex_norm
def test_apex_grad_norm_matches_native():
    grad = torch.randn(3_000_017, generator=torch.Generator().manual_seed(2)).cuda()
    ranges = [(0, 1000), (1000, 2_000_000), (2_500_000, 3_000_017)]
    native, fused = local_sumsq(grad, ranges, "native"), local_sumsq(grad, ranges, "apex")
    assert fused.dtype == torch.float64 and fused.item() == pytest.approx(native.item(), rel=1e-5)
    grad[5] = float("inf")  # an overflow shows in both, so fp16 skips the step either way
    assert not torch.isfinite(local_sumsq(grad, ranges, "apex"))
