"""Pure-torch reference implementations of MegaTier's native ops.

These define the semantics that the compiled kernels in ``megatier/csrc`` must
reproduce. They are also the fallback when the extension is not built.
"""
from __future__ import annotations

import math

import numpy as np
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
    # Both divisions tensor by tensor: torch computes a division by a Python scalar on CUDA, and a scalar divided
    # by a tensor everywhere, as a multiplication by the reciprocal, one rounding off the kernels' division.
    # A NaN block's scale is the canonical NaN whatever the input's NaN bits and the device (a GPU's arithmetic
    # makes every NaN 0x7fffffff), as the kernels write it.
    scales = torch.where(amax.isnan(), torch.nan, amax / torch.full_like(amax, 127.0))
    inv = torch.full_like(amax, 127.0) / amax
    q = torch.round(xb * inv[:, None]).clamp_(-127.0, 127.0).nan_to_num_(0.0)
    return q.to(torch.int8).view(-1)[:n].contiguous(), scales.contiguous()


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """Inverse of :func:`quantize_int8`: ``code * scale`` of its block, as fp32."""
    n = codes.numel()
    nb = scales.numel()
    cb = torch.nn.functional.pad(codes, (0, nb * block_size - n)).view(nb, block_size)
    return (cb.to(torch.float32) * scales[:, None]).view(-1)[:n].contiguous()


def signed64(v: int) -> int:
    """``v`` as the C kernels' int64 (two's complement of its low 64 bits)."""
    v &= 0xFFFFFFFFFFFFFFFF
    return v - (1 << 64) if v >= 1 << 63 else v


def chunk_seed(seed: int, seg: int, chunk: int) -> int:
    """Seed of chunk ``chunk`` of top-k segment ``seg`` (mirrors ``megatier/csrc/common.h``)."""
    return signed64(seed + seg * 1000003 + chunk)


def topk_target(n: int, ratio: float) -> int:
    """Number of entries a top-k at ``ratio`` aims to keep out of ``n`` (at least 1, at most n)."""
    if n <= 0:
        return 0
    return max(1, min(n, int(ratio * n + 0.5)))


def magnitude_keys(x: torch.Tensor) -> torch.Tensor:
    """int32 keys ordered like ``|x|`` (NaN above +inf): the float bits with the sign cleared."""
    return x.view(torch.int32) & 0x7FFFFFFF


SAMPLE_RUN = 16  # elements per sampled run (one 64-byte line of fp32)
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def effective_sample_size(n: int, sample_size: int) -> int:
    """Elements sampled for a chunk of ``n``: ``sample_size``, but no more than ``n / 64`` (and no fewer than
    2048), so that sampling stays a small fraction of the pass over the chunk."""
    return min(sample_size, max(2048, n // 64))


def sample_run_starts(n: int, sample_size: int, seed: int) -> np.ndarray:
    """Starts (int64, ascending) of the :data:`SAMPLE_RUN`-element runs a chunk of ``n`` samples: one random
    line in each of ``ceil(sample_size / SAMPLE_RUN)`` equal strata of the chunk's lines, drawn by splitmix64
    from ``seed`` (the same positions as the CPU and CUDA kernels, ``megatier/csrc/common.h``)."""
    nruns = -(-sample_size // SAMPLE_RUN)
    nlines = -(-n // SAMPLE_RUN)
    r = np.arange(nruns + 1, dtype=np.int64 if nlines * (nruns + 1) < 2**63 else object)  # exact products
    bounds = (r * nlines // nruns).astype(np.int64)
    lo, hi = bounds[:-1], bounds[1:]
    with np.errstate(over="ignore"):
        z = np.uint64(seed % 2**64) + (np.arange(1, nruns + 1, dtype=np.uint64) * np.uint64(_GOLDEN))
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
        z ^= z >> np.uint64(31)
    keep = hi > lo
    span = (hi - lo)[keep].astype(np.uint64)
    return (lo[keep] + (z[keep] % span).astype(np.int64)) * SAMPLE_RUN


def sample_positions(n: int, sample_size: int, seed: int) -> np.ndarray:
    """The element positions (int64) whose magnitudes set a chunk's sampled threshold: every element of each
    run of :func:`sample_run_starts` (for ``effective_sample_size``), the last run cut at the chunk's end."""
    starts = sample_run_starts(n, effective_sample_size(n, sample_size), seed)
    pos = (starts[:, None] + np.arange(SAMPLE_RUN, dtype=np.int64)).reshape(-1)
    return pos[pos < n]


def sparsify_topk(x: torch.Tensor, ratio: float, sample_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled-threshold top-k of one chunk (``x.numel() <= 2**31 - 1``).

    ``k = topk_target(n, ratio)``. With ``k >= n`` every nonzero element is kept. With ``n > sample_size``
    the threshold is the ``topk_target(S, ratio)``-th largest magnitude key of the ``S`` elements at
    :func:`sample_positions` (at least 1: exact zeros are never kept), and every element at or above it is
    kept, if that keeps between ``k / 2`` and ``2 k``. Otherwise (and for ``n <= sample_size``) the threshold
    is exact: the k largest magnitudes, ties going to the lowest indices (all nonzeros when fewer than k
    exist). Returns ``(values fp16, indices int32)`` with indices ascending.
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
        sample = keys[torch.from_numpy(sample_positions(n, sample_size, seed)).to(x.device)].cpu()
        t = max(int(torch.kthvalue(sample, sample.numel() - topk_target(sample.numel(), ratio) + 1).values), 1)
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


def compress_pools(flat: torch.Tensor, offsets: list[int], numels: list[int], codecs: list[str],
                   h: dict) -> tuple[dict[str, torch.Tensor], list[int]]:
    """A record's pools (by name; those no segment uses left out) and top-k chunk counts, coded segment by
    segment: the definition the batched and compiled paths reproduce bitwise. ``h``: the record header."""
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in
                                            ("int8_codes", "int8_scales", "topk_values", "topk_indices",
                                             "bf16_values", "fp32_values")}
    chunk_counts = []
    for s, (off, num, codec) in enumerate(zip(offsets, numels, codecs)):
        x = flat[off : off + num]
        if codec == "int8":
            codes, scales = quantize_int8(x, h["block_size"])
            parts["int8_codes"].append(codes)
            parts["int8_scales"].append(scales)
        elif codec == "topk":
            for ci, start in enumerate(range(0, num, h["chunk_size"])):
                v, i = sparsify_topk(x[start : start + h["chunk_size"]], h["ratio"], h["sample_size"],
                                     chunk_seed(h["seed"], s, ci))
                parts["topk_values"].append(v)
                parts["topk_indices"].append(i)
                chunk_counts.append(v.numel())
        elif codec == "bf16":
            parts["bf16_values"].append(x.to(torch.bfloat16))
        else:
            parts["fp32_values"].append(x.clone())
    return {name: torch.cat(p) for name, p in parts.items() if p}, chunk_counts
