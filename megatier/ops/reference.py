"""Pure-torch reference implementations of MegaTier's native ops.

These define the semantics that the compiled kernels in ``megatier/csrc`` must
reproduce. They are also the fallback when the extension is not built.
"""
from __future__ import annotations

import math

import torch


def adamw_scalars(step: int, lr: float, beta1: float, beta2: float) -> tuple[float, float]:
    """Host-side scalars of one AdamW step, computed in float64.

    Returns ``(step_size, bias_correction2_sqrt)`` where
    ``step_size = lr / (1 - beta1**step)`` and ``bias_correction2_sqrt = sqrt(1 - beta2**step)``.
    Kernels receive these exact values so every implementation agrees on them.
    """
    if step < 1:
        raise ValueError(f"AdamW step must be >= 1 (got {step}); step counts start at 1")
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    return lr / bias_correction1, math.sqrt(bias_correction2)


def _check_flat(param, exp_avg, exp_avg_sq, grad) -> None:
    for name, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("grad", grad)):
        if t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"adamw: {name} must be a contiguous 1-D float32 tensor, got {t.dtype} {tuple(t.shape)}")
    n = param.numel()
    if not (exp_avg.numel() == exp_avg_sq.numel() == grad.numel() == n):
        raise ValueError("adamw: param, exp_avg, exp_avg_sq and grad must have the same number of elements")


def adamw_step(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, step: int,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               decay_segments: torch.Tensor) -> None:
    """One in-place AdamW step (decoupled weight decay) over a flat fp32 shard.

    ``decay_segments`` is an int64 tensor of shape (k, 2) holding shard-local
    half-open ranges ``[start, end)`` that receive weight decay; elements outside
    every range (biases, norms) are not decayed. Per element, in this order::

        p = p * (1 - lr * wd)                        # only inside decay ranges
        m = m * beta1 + (1 - beta1) * g
        v = v * beta2 + (1 - beta2) * g * g
        p = p - step_size * m / (sqrt(v) * (1 / bc2_sqrt) + eps)

    (a multiply by the float32 reciprocal, not a division: one division fewer per element
    in the division-bound kernels).
    """
    _check_flat(param, exp_avg, exp_avg_sq, grad)
    step_size, bc2_sqrt = adamw_scalars(step, lr, beta1, beta2)
    if weight_decay != 0.0:
        keep = 1.0 - lr * weight_decay
        for start, end in decay_segments.tolist():
            param[start:end].mul_(keep)
    exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    denom = exp_avg_sq.sqrt().mul_(1.0 / bc2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def adamw_replay(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grads,
    steps,
    lrs,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decay_segments: torch.Tensor,
    skipped=None,
) -> None:
    """N AdamW steps as N calls of :func:`adamw_step` (the definition the fused kernel must match).

    ``grads`` are dense fp32 tensors (or callables returning one, so compressed
    records are decoded one at a time). A step whose ``skipped`` flag is set
    applies nothing.
    """
    for i, grad in enumerate(grads):
        if skipped is not None and skipped[i]:
            continue
        if callable(grad):
            grad = grad()
        adamw_step(param, exp_avg, exp_avg_sq, grad, steps[i], lrs[i], beta1, beta2, eps, weight_decay, decay_segments)


# ---------------------------------------------------------------------------
# Compression codecs. Semantics shared with megatier/csrc/compression.cpp.


def quantize_int8(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise symmetric INT8 over blocks of ``block_size`` elements (the last may be shorter).

    In float32: ``amax = max|x|`` of the block, ``scale = amax / 127``, ``inv = 127 / amax``,
    ``code = round_half_even(clamp(x * inv, -127, 127))``; NaN codes (all-zero or NaN blocks)
    become 0. Returns ``(codes int8[n], scales fp32[ceil(n / block_size)])``.
    """
    n = x.numel()
    nb = (n + block_size - 1) // block_size
    xb = torch.nn.functional.pad(x, (0, nb * block_size - n)).view(nb, block_size)
    amax = xb.abs().amax(dim=1) if nb else x.new_empty(0)
    scales = amax / 127.0
    inv = torch.full_like(amax, 127.0) / amax  # (not 127.0 / amax: torch computes that as reciprocal * 127)
    q = torch.round(xb * inv[:, None]).clamp_(-127.0, 127.0).nan_to_num_(0.0)
    return q.to(torch.int8).view(-1)[:n].contiguous(), scales.contiguous()


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """Inverse of :func:`quantize_int8`: ``code * scale`` of its block, as fp32."""
    n = codes.numel()
    nb = scales.numel()
    cb = torch.nn.functional.pad(codes, (0, nb * block_size - n)).view(nb, block_size)
    return (cb.to(torch.float32) * scales[:, None]).view(-1)[:n].contiguous()


def topk_target(n: int, ratio: float) -> int:
    """Number of entries a top-k at ``ratio`` aims to keep out of ``n`` (at least 1, at most n)."""
    if n <= 0:
        return 0
    return max(1, min(n, int(ratio * n + 0.5)))


def magnitude_keys(x: torch.Tensor) -> torch.Tensor:
    """int32 keys ordered like ``|x|`` (NaN above +inf): the float bits with the sign cleared."""
    return x.view(torch.int32) & 0x7FFFFFFF


def sparsify_topk(x: torch.Tensor, ratio: float, sample_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled-threshold top-k of one chunk (``x.numel() <= 2**31 - 1``).

    The threshold is the ``ratio`` quantile of the magnitudes of a seeded random
    sample (exact when ``n <= sample_size``); every element at or above it is kept.
    If the kept count is outside ``[k / 2, 2 k]`` (``k = topk_target(n, ratio)``)
    the threshold is made exact: the k largest magnitudes are kept, ties going to
    the lowest indices. Exact zeros are never kept. Returns ``(values fp16, indices int32)``
    with indices ascending.
    """
    n = x.numel()
    if n == 0:
        return x.new_empty(0, dtype=torch.float16), x.new_empty(0, dtype=torch.int32)
    keys = magnitude_keys(x)
    k = topk_target(n, ratio)
    mask = None
    if k >= n:
        mask = keys >= 1
    elif n > sample_size:
        gen = torch.Generator().manual_seed(int(seed) & 0x7FFFFFFFFFFFFFFF)
        sample = keys[torch.randint(0, n, (sample_size,), generator=gen).to(x.device)]
        ks = topk_target(sample_size, ratio)
        t = max(int(torch.kthvalue(sample.cpu(), sample_size - ks + 1).values), 1)
        mask = keys >= t
        c = int(mask.sum())
        if not (2 * c >= k and c <= 2 * k):
            mask = None
    if mask is None:
        t = int(torch.kthvalue(keys.cpu(), n - k + 1).values)
        if t == 0:
            mask = keys >= 1
        else:
            gt = keys > t
            eq = keys == t
            allow = k - int(gt.sum())
            mask = gt | (eq & (torch.cumsum(eq, 0) <= allow))
    idx = mask.nonzero().view(-1)
    return x[idx].to(torch.float16), idx.to(torch.int32)


def densify(values: torch.Tensor, indices: torch.Tensor, n: int, chunk_counts=None,
            chunk_size: int = 2**31 - 1) -> torch.Tensor:
    """Scatter fp16 ``values`` at ``indices`` into a zero fp32 tensor of ``n`` elements.

    Indices are local to their chunk of ``chunk_size`` elements; ``chunk_counts[c]``
    says how many entries belong to chunk ``c`` (one chunk when omitted).
    """
    out = torch.zeros(n, dtype=torch.float32, device=values.device)
    idx = indices.to(torch.int64)
    if chunk_counts is not None and len(chunk_counts) > 1:
        counts = torch.as_tensor(chunk_counts, dtype=torch.int64, device=values.device)
        base = torch.arange(counts.numel(), dtype=torch.int64, device=values.device) * chunk_size
        idx = idx + torch.repeat_interleave(base, counts)
    out[idx] = values.to(torch.float32)
    return out
