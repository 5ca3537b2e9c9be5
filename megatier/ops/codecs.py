"""The gradient codecs, each with its inverse, on flat fp32 tensors (native kernels or the reference).

* :func:`quantize_int8` / :func:`dequantize_int8`: blockwise INT8, one fp32 scale per block.
* :func:`sparsify_topk` / :func:`densify`: sampled-threshold top-k, fp16 values and int32
  indices, chunked past 2**31 - 1 elements (indices are chunk-local and rebased by densify).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional

import torch

from megatier.ops import _native, reference

MODES = ("adaptive", "int8", "topk", "bf16", "fp32")
DEFAULT_RATIO = 0.01
DEFAULT_SMALL_THRESHOLD = 100_000
DEFAULT_BLOCK_SIZE = 256
DEFAULT_SAMPLE_SIZE = 16384
TOPK_CHUNK_ELEMS = 2**31 - 1  # int32 indices: a chunk holds at most this many elements


class TopK(NamedTuple):
    """Result of :func:`sparsify_topk`: ``values`` fp16, ``indices`` int32 (ascending within
    each chunk, relative to the chunk start) and ``chunk_counts`` int64 (entries per chunk)."""

    values: torch.Tensor
    indices: torch.Tensor
    chunk_counts: torch.Tensor

# ---------------------------------------------------------------------------
# Validation


def check_flat(t: Any, op: str, name: str, dtype: torch.dtype = torch.float32) -> None:
    """Raise a clear error unless ``t`` is a contiguous 1-D tensor of ``dtype``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{op}: {name} must be {dtype}, got {t.dtype}; convert it with .to({dtype})")
    if t.dim() != 1:
        raise ValueError(f"{op}: {name} must be 1-D, got shape {tuple(t.shape)}; flatten it with .view(-1)")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous; call .contiguous() first")


def _check_int(v: Any, op: str, name: str, lo: int, hi: Optional[int] = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        try:
            import numbers

            if not isinstance(v, numbers.Integral):
                raise TypeError
            v = int(v)
        except TypeError:
            raise TypeError(f"{op}: {name} must be an int, got {type(v).__name__}") from None
    if v < lo or (hi is not None and v > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"{op}: {name} must be {bound}, got {v}")
    return v


def _check_out(out: Optional[torch.Tensor], n: int, device: torch.device, op: str) -> None:
    if out is None:
        return
    check_flat(out, op, "out")
    if out.numel() != n:
        raise ValueError(f"{op}: out has {out.numel()} elements, expected {n}")
    if out.device != device:
        raise ValueError(f"{op}: out is on {out.device}, expected {device}")


def _check_ratio(ratio: Any, op: str) -> float:
    ratio = float(ratio)
    if not (0.0 < ratio <= 1.0):
        raise ValueError(f"{op}: ratio must be in (0, 1], got {ratio}")
    return ratio


# ---------------------------------------------------------------------------
# Codecs


def quantize_int8(
    x: torch.Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise INT8 of a flat fp32 tensor: ``(codes int8[n], scales fp32[ceil(n / block_size)])``.

    Per block ``amax = max|x|``, ``scale = amax / 127``, ``code = round_half_even(x * (127 / amax))``
    clamped to [-127, 127] (see :func:`megatier.ops.reference.quantize_int8`). ``out``: optional
    preallocated ``(codes, scales)`` to write into.
    """
    op = "quantize_int8"
    check_flat(x, op, "x")
    block_size = _check_int(block_size, op, "block_size", 1)
    codes_out = scales_out = None
    if out is not None:
        codes_out, scales_out = out
        check_flat(codes_out, op, "out[0] (codes)", torch.int8)
        check_flat(scales_out, op, "out[1] (scales)", torch.float32)
        nb = (x.numel() + block_size - 1) // block_size
        if codes_out.numel() != x.numel() or scales_out.numel() != nb:
            raise ValueError(f"{op}: out must hold {x.numel()} codes and {nb} scales")
        if codes_out.device != x.device or scales_out.device != x.device:
            raise ValueError(f"{op}: out tensors must be on {x.device}")
    if _native.use_native(x):
        return tuple(_native.lib().quantize_int8(x, block_size, codes_out, scales_out))  # type: ignore[return-value]
    codes, scales = reference.quantize_int8(x, block_size)
    if out is None:
        return codes, scales
    return codes_out.copy_(codes), scales_out.copy_(scales)


def dequantize_int8(
    codes: torch.Tensor,
    scales: torch.Tensor,
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Inverse of :func:`quantize_int8`: fp32 ``code * scale`` of each block (written into ``out`` if given)."""
    op = "dequantize_int8"
    check_flat(codes, op, "codes", torch.int8)
    check_flat(scales, op, "scales", torch.float32)
    _check_out(out, codes.numel(), codes.device, op)
    block_size = _check_int(block_size, op, "block_size", 1)
    nb = (codes.numel() + block_size - 1) // block_size
    if scales.numel() != nb:
        raise ValueError(
            f"{op}: scales has {scales.numel()} elements but {codes.numel()} codes in blocks of {block_size} "
            f"need {nb}; pass the block_size used by quantize_int8"
        )
    if codes.device != scales.device:
        raise ValueError(f"{op}: codes is on {codes.device} but scales is on {scales.device}")
    if _native.use_native(codes):
        return _native.lib().dequantize_int8(codes, scales, block_size, out)
    res = reference.dequantize_int8(codes, scales, block_size)
    return res if out is None else out.copy_(res)


def _sparsify_chunk(x: torch.Tensor, ratio: float, sample_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    if _native.use_native(x):
        return tuple(_native.lib().sparsify_topk(x, ratio, sample_size, seed))  # type: ignore[return-value]
    return reference.sparsify_topk(x, ratio, sample_size, seed)


def sparsify_topk(
    x: torch.Tensor,
    ratio: float = DEFAULT_RATIO,
    sample_size: int = DEFAULT_SAMPLE_SIZE,
    seed: int = 0,
    *,
    chunk_size: int = TOPK_CHUNK_ELEMS,
) -> TopK:
    """Keep about ``ratio * n`` largest-magnitude entries of a flat fp32 tensor.

    The magnitude threshold is estimated from a seeded random sample of ``sample_size``
    elements and applied in one compacting pass; when the kept count lands outside
    ``[k / 2, 2 k]`` (``k = round(ratio * n)``) the threshold is made exact and the
    pass redone. Exact zeros are never kept. Deterministic for a given seed.
    Tensors longer than ``chunk_size`` (default and maximum 2**31 - 1) are processed
    in chunks whose int32 indices are chunk-local; :func:`densify` rebases them.
    """
    op = "sparsify_topk"
    check_flat(x, op, "x")
    ratio = _check_ratio(ratio, op)
    sample_size = _check_int(sample_size, op, "sample_size", 1)
    seed = _check_int(seed, op, "seed", -(2**63), 2**64 - 1)
    chunk_size = _check_int(chunk_size, op, "chunk_size", 1, TOPK_CHUNK_ELEMS)
    n = x.numel()
    if n <= chunk_size:
        values, indices = _sparsify_chunk(x, ratio, sample_size, reference.signed64(seed))
        counts = torch.tensor([values.numel()] if n else [], dtype=torch.int64)
        return TopK(values, indices, counts)
    vals, idxs, counts = [], [], []
    for c, start in enumerate(range(0, n, chunk_size)):
        v, i = _sparsify_chunk(x[start : start + chunk_size], ratio, sample_size, reference.chunk_seed(seed, 0, c))
        vals.append(v)
        idxs.append(i)
        counts.append(v.numel())
    return TopK(torch.cat(vals), torch.cat(idxs), torch.tensor(counts, dtype=torch.int64))


def densify(
    values: torch.Tensor,
    indices: torch.Tensor,
    n: int,
    *,
    chunk_counts: Optional[torch.Tensor] = None,
    chunk_size: int = TOPK_CHUNK_ELEMS,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Dense fp32 tensor of ``n`` elements: ``values`` at ``indices``, zero elsewhere (into ``out`` if given).

    With ``chunk_counts`` (from :func:`sparsify_topk`), entry ``e`` of chunk ``c`` lands at
    ``c * chunk_size + indices[e]``.
    """
    op = "densify"
    check_flat(values, op, "values", torch.float16)
    check_flat(indices, op, "indices", torch.int32)
    n = _check_int(n, op, "n", 0)
    chunk_size = _check_int(chunk_size, op, "chunk_size", 1, TOPK_CHUNK_ELEMS)
    _check_out(out, n, values.device, op)
    if values.numel() != indices.numel():
        raise ValueError(
            f"{op}: values has {values.numel()} elements but indices has {indices.numel()}; "
            "pass the pair returned by sparsify_topk"
        )
    if values.device != indices.device:
        raise ValueError(f"{op}: values is on {values.device} but indices is on {indices.device}")
    nchunks = (n + chunk_size - 1) // chunk_size
    if chunk_counts is not None:
        chunk_counts = torch.as_tensor(chunk_counts, dtype=torch.int64).reshape(-1).cpu().contiguous()
        if chunk_counts.numel() != nchunks:
            raise ValueError(
                f"{op}: chunk_counts has {chunk_counts.numel()} entries but n={n} in chunks of {chunk_size} "
                f"has {nchunks}; pass the chunk_size used by sparsify_topk"
            )
        if int(chunk_counts.sum()) != values.numel():
            raise ValueError(f"{op}: chunk_counts sum to {int(chunk_counts.sum())} but there are {values.numel()} "
                             "values")
    elif nchunks > 1:
        raise ValueError(f"{op}: n={n} spans {nchunks} chunks of {chunk_size}; pass chunk_counts from sparsify_topk")
    if _native.use_native(values):
        return _native.lib().densify(values, indices, n, chunk_counts, chunk_size, out)
    if values.numel():
        bound = min(n, chunk_size)
        if int(indices.min()) < 0 or int(indices.max()) >= bound:
            raise ValueError(f"{op}: indices must lie in [0, {bound}) (chunk-local); the record is corrupt")
    res = reference.densify(values, indices, n, chunk_counts, chunk_size)
    return res if out is None else out.copy_(res)
