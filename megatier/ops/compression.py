"""Compressing a gradient shard per parameter segment (:func:`compress_segments`) and back; the record one
would make, planned without a gradient (:func:`planned_record`).

The differential checkpoint stream calls these: one :class:`~megatier.ops.records.CompressedRecord`
per step, each segment coded by :mod:`megatier.ops.codecs` (adaptive: INT8 for small
segments, top-k for large ones; or one lossy or lossless codec for all).
"""
from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence

import torch

from megatier.ops import _native, batched, reference
from megatier.ops.codecs import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_RATIO,
    DEFAULT_SAMPLE_SIZE,
    DEFAULT_SMALL_THRESHOLD,
    MODES,
    TOPK_CHUNK_ELEMS,
    _check_int,
    _check_ratio,
    check_flat,
)
from megatier.ops.records import CODEC_KIND, PIECE_INT8, PIECE_TOPK, POOLS, RECORD_FORMAT, CompressedRecord


def _normalize_segments(segments: Any, n: int, op: str) -> tuple[list[int], list[int]]:
    if segments is None:
        return [0], [n]
    if isinstance(segments, torch.Tensor):
        segments = segments.tolist()
    offsets, numels = [], []
    for i, seg in enumerate(segments):
        if hasattr(seg, "offset") and hasattr(seg, "numel"):
            off, num = seg.offset, seg.numel
            num = num() if callable(num) else num
        else:
            try:
                off, num = seg
            except (TypeError, ValueError):
                raise TypeError(f"{op}: segments[{i}] must be an (offset, numel) pair or have .offset and .numel, "
                                f"got {seg!r}") from None
        offsets.append(int(off))
        numels.append(int(num))
    pos = 0
    for i, (off, num) in enumerate(zip(offsets, numels)):
        if off != pos or num < 0:
            raise ValueError(
                f"{op}: segments[{i}] = ({off}, {num}) but the previous segment ended at {pos}; "
                "segments must be shard-local (offset, numel) pairs that tile the flat tensor in order"
            )
        pos += num
    if pos != n:
        raise ValueError(f"{op}: segments cover {pos} elements but flat has {n}; add the missing segment(s)")
    return offsets, numels


def compress_segments(
    flat: torch.Tensor,
    segments: Any = None,
    mode: str = "adaptive",
    ratio: float = DEFAULT_RATIO,
    small_threshold: int = DEFAULT_SMALL_THRESHOLD,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    sample_size: int = DEFAULT_SAMPLE_SIZE,
    seed: int = 0,
    chunk_size: int = TOPK_CHUNK_ELEMS,
    feedback: bool = False,
    addend: Optional[torch.Tensor] = None,
) -> CompressedRecord:
    """Compress a flat fp32 gradient shard per parameter segment into one :class:`CompressedRecord`.

    ``segments``: shard-local ``(offset, numel)`` pairs (or objects with ``.offset``/``.numel``)
    tiling ``flat`` in order; ``None`` means one segment. ``mode``: ``"adaptive"`` (INT8 for
    segments below ``small_threshold`` elements, top-k at ``ratio`` from it up), ``"int8"``,
    ``"topk"``, or lossless ``"bf16"`` / ``"fp32"``.

    ``feedback``: also leave ``flat - decompress_segments(record)`` in ``flat`` (error feedback: what the
    record left out), bitwise that expression; on CPU computed inside the compression pass, touching only
    the kept entries of top-k segments, instead of two more passes over the shard.

    ``addend``: compress ``flat + addend`` instead, leaving that sum in ``flat`` (before any feedback): bitwise
    ``flat.add_(addend)`` first, but on CPU folded into the compression's own pass over ``flat`` (error
    feedback's residual plus a step's gradient: one read of the 4-byte-per-element shard fewer, which matters
    when the shard is not in cache).

    On a GPU :mod:`megatier.ops.batched` codes the shard without waiting for the device, and the record comes
    back in (pinned) host memory after one transfer.
    """
    op = "compress_segments"
    check_flat(flat, op, "flat")
    if addend is not None:
        check_flat(addend, op, "addend")
        if addend.shape != flat.shape or addend.device != flat.device or addend.data_ptr() == flat.data_ptr():
            raise ValueError(f"{op}: addend must be another fp32 tensor of flat's shape {tuple(flat.shape)} on "
                             f"{flat.device}, got shape {tuple(addend.shape)} on {addend.device}")
    header = _record_header(op, flat.numel(), mode, ratio, small_threshold, block_size, sample_size, seed,
                            chunk_size)
    offsets, numels = _normalize_segments(segments, flat.numel(), op)
    codecs = _codecs(mode, numels, header["small_threshold"])
    native = flat.device.type == "cpu" and _native.use_native(flat)
    if addend is not None and not native:
        flat.add_(addend)
        addend = None
    if native:  # the addend and feedback, if asked, are applied inside this pass
        h = header
        codes, scales, tv, ti, tc, bf, fp = _native.lib().compress_segments(
            flat, offsets, numels, [CODEC_KIND[c] for c in codecs], h["ratio"], h["block_size"], h["sample_size"],
            reference.signed64(h["seed"]), h["chunk_size"], feedback, addend)
        pools, chunk_counts = dict(zip(POOLS, (codes, scales, tv, ti, bf, fp))), tc.tolist()
    elif flat.device.type == "cpu":  # without the extension: segment by segment, the definition
        pools, chunk_counts = reference.compress_pools(flat, offsets, numels, codecs, header)
    else:  # a GPU: the whole shard at once, feedback included, then one copy to the host
        pools, counts, plan = batched.compress_pools(flat, offsets, numels, codecs, header, feedback)
        pools, chunk_counts = batched.PendingRecord(pools, counts, plan).wait()
    header["segments"] = _segment_table(offsets, numels, codecs, chunk_counts, header)
    record = CompressedRecord(header, {name: t for name, t in pools.items() if t.numel()})
    if feedback and not native and flat.device.type == "cpu":
        flat.sub_(decompress_segments(record))
    return record


def _record_header(op: str, n: int, mode: str, ratio: float, small_threshold: int, block_size: int,
                   sample_size: int, seed: int, chunk_size: int) -> dict[str, Any]:
    """A record's header before its segment table, every setting checked."""
    if mode not in MODES:
        raise ValueError(f"{op}: mode must be one of {MODES}, got {mode!r}")
    return {
        "format": RECORD_FORMAT, "mode": mode, "n": n, "ratio": _check_ratio(ratio, op),
        "small_threshold": _check_int(small_threshold, op, "small_threshold", 0),
        "block_size": _check_int(block_size, op, "block_size", 1),
        "sample_size": _check_int(sample_size, op, "sample_size", 1),
        "seed": _check_int(seed, op, "seed", -(2**63), 2**64 - 1),
        "chunk_size": _check_int(chunk_size, op, "chunk_size", 1, TOPK_CHUNK_ELEMS),
    }


def _codecs(mode: str, numels: list[int], small_threshold: int) -> list[str]:
    """The codec of each segment: adaptive picks INT8 below ``small_threshold`` elements, top-k from it up."""
    if mode == "adaptive":
        return ["int8" if k < small_threshold else "topk" for k in numels]
    return [mode] * len(numels)


def planned_record(
    numels: Sequence[int],
    mode: str = "adaptive",
    ratio: float = DEFAULT_RATIO,
    small_threshold: int = DEFAULT_SMALL_THRESHOLD,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    sample_size: int = DEFAULT_SAMPLE_SIZE,
    seed: int = 0,
    chunk_size: int = TOPK_CHUNK_ELEMS,
) -> CompressedRecord:
    """The record :func:`compress_segments` makes of a gradient whose segments have ``numels`` elements, without
    a gradient: its header and its pools as meta tensors (dtype and size, no data), for a size plan.

    Exact for INT8, bf16 and fp32. A top-k chunk is planned at the count it aims for (``topk_target``): a real
    one keeps between half and twice that, close to it for a gradient's magnitudes.
    """
    header = _record_header("planned_record", sum(numels), mode, ratio, small_threshold, block_size, sample_size,
                            seed, chunk_size)
    offsets = list(itertools.accumulate([0, *numels[:-1]]))
    codecs = _codecs(mode, list(numels), header["small_threshold"])
    block, chunk = header["block_size"], header["chunk_size"]
    counts, sizes = [], dict.fromkeys(POOLS, 0)
    for num, codec in zip(numels, codecs):
        if codec == "int8":
            sizes["int8_codes"] += num
            sizes["int8_scales"] += (num + block - 1) // block
        elif codec == "topk":
            counts += [reference.topk_target(min(chunk, num - start), ratio) for start in range(0, num, chunk)]
        else:
            sizes[f"{codec}_values"] += num
    sizes["topk_values"] = sizes["topk_indices"] = sum(counts)
    header["segments"] = _segment_table(offsets, list(numels), codecs, counts, header)
    return CompressedRecord(header, {name: torch.empty(n, dtype=POOLS[name], device="meta")
                                     for name, n in sizes.items() if n})


def _segment_table(offsets: list[int], numels: list[int], codecs: list[str], chunk_counts: list[int],
                   h: dict) -> list[dict]:
    """The header's per-segment entries: where each segment's codes lie in the pools (see the record format)."""
    segs = []
    cs = ss = ts = bs_ = fs = 0
    chunk_iter = iter(chunk_counts)
    block_size, chunk_size = h["block_size"], h["chunk_size"]
    for off, num, codec in zip(offsets, numels, codecs):
        entry: dict[str, Any] = {"offset": off, "numel": num, "codec": codec}
        if codec == "int8":
            entry.update(codes_start=cs, scales_start=ss)
            cs += num
            ss += (num + block_size - 1) // block_size
        elif codec == "topk":
            chunks = []
            for start in range(0, num, chunk_size):
                cnt = int(next(chunk_iter))
                chunks.append([start, min(chunk_size, num - start), ts, cnt])
                ts += cnt
            entry["chunks"] = chunks
        elif codec == "bf16":
            entry["start"] = bs_
            bs_ += num
        else:
            entry["start"] = fs
            fs += num
        segs.append(entry)
    return segs


def _reference_decode(record: CompressedRecord, out: torch.Tensor) -> None:
    for kind, off, numel, param, t0, t1 in record.pieces():
        dst = out[off : off + numel]
        if kind == PIECE_INT8:
            dst.copy_(reference.dequantize_int8(t0, t1, param))
        elif kind == PIECE_TOPK:
            if t1.numel() and (int(t1.min()) < 0 or int(t1.max()) >= numel):
                raise ValueError("decompress_segments: top-k indices outside their chunk; the record is corrupt")
            dst.copy_(reference.densify(t0, t1, numel))
        else:
            dst.copy_(t0)


def decompress_segments(record: CompressedRecord, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Dense fp32 gradient (``record.n`` elements) of a :class:`CompressedRecord`; writes into ``out`` if given."""
    op = "decompress_segments"
    if not isinstance(record, CompressedRecord):
        raise TypeError(f"{op}: record must be a CompressedRecord, got {type(record).__name__}")
    record.validate()
    if out is None:
        out = torch.empty(record.n, dtype=torch.float32, device=record.device)
    else:
        check_flat(out, op, "out")
        if out.numel() != record.n:
            raise ValueError(f"{op}: out has {out.numel()} elements but the record holds {record.n}")
    if _native.use_native(out):
        _native.lib().decompress_into(out, record.pieces())
    else:
        _reference_decode(record, out)
    return out
