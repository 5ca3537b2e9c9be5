"""Python face of MegaTier's native ops (compiled in megatier/csrc).

Uses the compiled extension ``megatier._C`` when it is importable and falls
back to the pure-torch reference in :mod:`megatier.ops.reference` otherwise
(with a one-time RuntimeWarning). ``MEGATIER_REQUIRE_NATIVE=1`` turns a missing
extension into an ImportError; :func:`native_available` says which is in use.

Every op validates its arguments and raises TypeError/ValueError naming the
argument and the fix; the compiled kernels re-check (RuntimeError) so that bad
input never crashes the process.
"""
from megatier.ops._native import limit_thread_parallelism, native_available, native_info
from megatier.ops.adamw import adamw_replay, adamw_step
from megatier.ops.compression import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_RATIO,
    DEFAULT_SAMPLE_SIZE,
    DEFAULT_SMALL_THRESHOLD,
    MODES,
    RECORD_FORMAT,
    TOPK_CHUNK_ELEMS,
    CompressedRecord,
    TopK,
    compress_segments,
    decompress_segments,
    densify,
    dequantize_int8,
    pack_records,
    quantize_int8,
    sparsify_topk,
    unpack_records,
)
from megatier.ops.reference import adamw_scalars

__all__ = [
    "native_available",
    "native_info",
    "limit_thread_parallelism",
    "adamw_scalars",
    "adamw_step",
    "adamw_replay",
    "quantize_int8",
    "dequantize_int8",
    "sparsify_topk",
    "densify",
    "compress_segments",
    "decompress_segments",
    "CompressedRecord",
    "TopK",
    "pack_records",
    "unpack_records",
    "MODES",
    "RECORD_FORMAT",
    "TOPK_CHUNK_ELEMS",
    "DEFAULT_RATIO",
    "DEFAULT_SMALL_THRESHOLD",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_SAMPLE_SIZE",
]
