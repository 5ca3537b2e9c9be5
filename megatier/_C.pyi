"""Type stub of megatier._C, the compiled native ops (megatier/csrc).

Use these through :mod:`megatier.ops`, which validates arguments, computes the
AdamW scalars with :func:`megatier.ops.adamw_scalars` and falls back to the
pure-torch reference when the extension is missing. Every function releases the
GIL and raises RuntimeError on bad input. Each op runs on CPU (OpenMP) and, when
built with CUDA (``WITH_CUDA``), on CUDA tensors.
"""
from typing import Optional, Sequence

import torch

# (kind, offset, numel, param, t0, t1): one piece of a gradient; pieces tile [0, n) in order.
#   PIECE_FP32: t0 float32[numel]
#   PIECE_BF16: t0 bfloat16[numel]
#   PIECE_INT8: t0 int8[numel] codes, t1 float32[ceil(numel / param)] scales, param = block size
#   PIECE_TOPK: t0 float16[count] values, t1 int32[count] ascending piece-local indices (numel <= 2**31 - 1)
#   PIECE_ZERO: zero gradient on the range
Piece = tuple[int, int, int, int, torch.Tensor, torch.Tensor]

PIECE_FP32: int
PIECE_BF16: int
PIECE_INT8: int
PIECE_TOPK: int
PIECE_ZERO: int
MAX_TOPK_CHUNK: int
WITH_CUDA: bool

def quantize_int8(
    x: torch.Tensor,
    block_size: int,
    codes_out: Optional[torch.Tensor] = None,
    scales_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise INT8 of contiguous 1-D float32 ``x``: (codes int8[n], scales float32[ceil(n / block_size)])."""

def dequantize_int8(
    codes: torch.Tensor, scales: torch.Tensor, block_size: int, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """``codes * scale`` of each block as float32[n] (into ``out`` if given)."""

def sparsify_topk(x: torch.Tensor, ratio: float, sample_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled-threshold top-k of one chunk (n <= 2**31 - 1): (values float16, indices int32 ascending)."""

def densify(
    values: torch.Tensor,
    indices: torch.Tensor,
    n: int,
    chunk_counts: Optional[torch.Tensor] = None,
    chunk_size: int = ...,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """float32[n]: ``values`` at chunk-local ``indices`` (chunk c starts at c * chunk_size), zero elsewhere."""

def compress_segments(
    flat: torch.Tensor,
    offsets: Sequence[int],
    numels: Sequence[int],
    codecs: Sequence[int],
    ratio: float,
    block_size: int,
    sample_size: int,
    seed: int,
    chunk_size: int,
    feedback: bool = False,
) -> list[torch.Tensor]:
    """CPU only. Compress segment s of ``flat`` with codec ``codecs[s]`` (a PIECE_* kind other than ZERO).

    With ``feedback``, ``flat`` is left holding ``flat - decode(record)`` (the error-feedback residual),
    bitwise what decompressing the record and subtracting it gives.

    Returns the pools ``[int8 codes, int8 scales, topk values, topk indices, topk chunk counts (int64,
    one per chunk of each top-k segment, in order), bf16 values, fp32 values]``; top-k chunk c of
    segment s is sampled with seed ``seed + s * 1000003 + c``.
    """

def decompress_into(out: torch.Tensor, pieces: Sequence[Piece]) -> None:
    """Decode a piece list into the dense float32 ``out``."""

def adamw_step(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    step_size: float,
    bc2_sqrt: float,
    beta1: float,
    beta2: float,
    eps: float,
    keep: float,
    decay: bool,
    decay_segments: torch.Tensor,
) -> None:
    """One in-place AdamW step; ``keep = 1 - lr * weight_decay`` applies inside ``decay_segments`` when ``decay``."""

def adamw_replay(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grads: Sequence[Sequence[Piece]],
    step_sizes: Sequence[float],
    bc2_sqrts: Sequence[float],
    keeps: Sequence[float],
    skipped: Sequence[bool],
    beta1: float,
    beta2: float,
    eps: float,
    decay: bool,
    decay_segments: torch.Tensor,
) -> None:
    """N in-place AdamW steps in one pass; bitwise equal to N ``adamw_step`` calls for fp32 pieces."""

def set_thread_num_threads(n: int) -> bool:
    """Size of the OpenMP teams the calling thread starts (other threads keep theirs); False without OpenMP."""

def build_info() -> dict:
    """``{"cuda": bool, "openmp": bool, "max_threads": int, "max_topk_chunk": int}``."""
