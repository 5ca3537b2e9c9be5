"""Python face of MegaTier's native ops (compiled in megatier/csrc).

    codecs       INT8 and top-k codecs with their inverses
    records      CompressedRecord (one compressed gradient shard) and its serialization
    compression  compress_segments / decompress_segments: a shard per parameter segment; planned_record
    batched      a shard's compression as one fixed sequence of tensor ops with no host sync (the GPU's path),
                 bitwise the CPU kernel's records
    adamw        adamw_step and the fused multi-step adamw_replay
    reference    the pure-torch reference of every kernel
    _native      loading the compiled extension, or warning and falling back

Uses the compiled extension ``megatier._C`` when it is importable and falls
back to the pure-torch reference in :mod:`megatier.ops.reference` otherwise
(with a one-time RuntimeWarning). ``MEGATIER_REQUIRE_NATIVE=1`` turns a missing
extension into an ImportError; :func:`native_available` says which is in use.

Every op validates its arguments and raises TypeError/ValueError naming the
argument and the fix; the compiled kernels re-check (RuntimeError) so that bad
input never crashes the process.
"""
from megatier.ops._native import (limit_thread_parallelism, native_available, native_info, run_with_team_parked,
                                  thread_parallelism)
from megatier.ops.adamw import adamw_replay, adamw_step
from megatier.ops.codecs import (DEFAULT_BLOCK_SIZE, DEFAULT_RATIO, DEFAULT_SAMPLE_SIZE, DEFAULT_SMALL_THRESHOLD,
                                 MODES, TOPK_CHUNK_ELEMS, TopK, densify, dequantize_int8, quantize_int8,
                                 sparsify_topk)
from megatier.ops.compression import compress_segments, decompress_segments, planned_record
from megatier.ops.records import RECORD_FORMAT, CompressedRecord, pack_records, unpack_records
from megatier.ops.reference import adamw_scalars

__all__ = [
    "native_available",
    "native_info",
    "limit_thread_parallelism",
    "thread_parallelism",
    "run_with_team_parked",
    "adamw_scalars",
    "adamw_step",
    "adamw_replay",
    "quantize_int8",
    "dequantize_int8",
    "sparsify_topk",
    "densify",
    "compress_segments",
    "decompress_segments",
    "planned_record",
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
