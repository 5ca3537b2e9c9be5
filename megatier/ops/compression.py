"""Gradient compression for the differential checkpoint stream.

Codecs (each with its inverse):

* :func:`quantize_int8` / :func:`dequantize_int8`: blockwise INT8, one fp32 scale per block.
* :func:`sparsify_topk` / :func:`densify`: sampled-threshold top-k, fp16 values and int32
  indices, chunked past 2**31 - 1 elements (indices are chunk-local and rebased by densify).
* :func:`compress_segments` / :func:`decompress_segments`: one self-describing
  :class:`CompressedRecord` per gradient shard, coded per parameter segment.

Record format (``header["format"] == "megatier.grad/1"``), JSON-able header::

    {"format": "megatier.grad/1", "mode": "adaptive", "n": <shard elements>,
     "ratio": 0.01, "small_threshold": 100000, "block_size": 256, "sample_size": 16384,
     "seed": 0, "chunk_size": 2147483647,
     "segments": [
       {"offset": o, "numel": k, "codec": "int8", "codes_start": c, "scales_start": s},
       {"offset": o, "numel": k, "codec": "topk", "chunks": [[rel_offset, length, start, count], ...]},
       {"offset": o, "numel": k, "codec": "bf16", "start": s},
       {"offset": o, "numel": k, "codec": "fp32", "start": s}]}

and tensors (only the pools in use are present): ``int8_codes`` int8, ``int8_scales``
fp32 (block ``b`` of an int8 segment has scale ``int8_scales[scales_start + b]``),
``topk_values`` fp16 and ``topk_indices`` int32 (indices relative to the chunk start
``offset + rel_offset``, ascending), ``bf16_values`` bf16, ``fp32_values`` fp32.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Sequence

import torch

from megatier.ops import _native, reference

RECORD_FORMAT = "megatier.grad/1"
MODES = ("adaptive", "int8", "topk", "bf16", "fp32")
DEFAULT_RATIO = 0.01
DEFAULT_SMALL_THRESHOLD = 100_000
DEFAULT_BLOCK_SIZE = 256
DEFAULT_SAMPLE_SIZE = 16384
TOPK_CHUNK_ELEMS = 2**31 - 1  # int32 indices: a chunk holds at most this many elements

# Piece kinds shared with megatier/csrc/common.h.
PIECE_FP32, PIECE_BF16, PIECE_INT8, PIECE_TOPK, PIECE_ZERO = 0, 1, 2, 3, 4
_CODEC_KIND = {"fp32": PIECE_FP32, "bf16": PIECE_BF16, "int8": PIECE_INT8, "topk": PIECE_TOPK}
_POOLS = {
    "int8_codes": torch.int8,
    "int8_scales": torch.float32,
    "topk_values": torch.float16,
    "topk_indices": torch.int32,
    "bf16_values": torch.bfloat16,
    "fp32_values": torch.float32,
}


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


def _signed64(v: int) -> int:
    v &= 0xFFFFFFFFFFFFFFFF
    return v - (1 << 64) if v >= 1 << 63 else v


def _chunk_seed(seed: int, seg: int, chunk: int) -> int:
    """Seed of chunk ``chunk`` of top-k segment ``seg`` (mirrors megatier/csrc/common.h)."""
    return _signed64(seed + seg * 1000003 + chunk)


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
        values, indices = _sparsify_chunk(x, ratio, sample_size, _signed64(seed))
        counts = torch.tensor([values.numel()] if n else [], dtype=torch.int64)
        return TopK(values, indices, counts)
    vals, idxs, counts = [], [], []
    for c, start in enumerate(range(0, n, chunk_size)):
        v, i = _sparsify_chunk(x[start : start + chunk_size], ratio, sample_size, _chunk_seed(seed, 0, c))
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
            raise ValueError(f"{op}: chunk_counts sum to {int(chunk_counts.sum())} but there are {values.numel()} values")
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


# ---------------------------------------------------------------------------
# Records


@dataclass
class CompressedRecord:
    """One compressed gradient shard: a JSON-able ``header`` and named ``tensors`` (see module doc)."""

    header: dict
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def n(self) -> int:
        """Number of elements of the dense gradient."""
        return int(self.header["n"])

    @property
    def mode(self) -> str:
        return str(self.header["mode"])

    @property
    def nbytes(self) -> int:
        """Bytes of tensor payload (the header adds a few hundred bytes of JSON)."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def device(self) -> torch.device:
        for t in self.tensors.values():
            return t.device
        return torch.device("cpu")

    def to(self, device: torch.device | str) -> "CompressedRecord":
        return CompressedRecord(dict(self.header), {k: v.to(device) for k, v in self.tensors.items()})

    # -- serialization -----------------------------------------------------
    def to_safetensors_dict(self, prefix: str = "") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """``(tensors, metadata)`` for ``safetensors.torch.save``; ``prefix`` lets N records share one file."""
        tensors = {prefix + k: v.contiguous() for k, v in self.tensors.items()}
        return tensors, {prefix + "header": json.dumps(self.header, separators=(",", ":"))}

    @classmethod
    def from_safetensors_dict(
        cls, tensors: dict[str, torch.Tensor], metadata: dict[str, str], prefix: str = ""
    ) -> "CompressedRecord":
        key = prefix + "header"
        if key not in metadata:
            raise ValueError(f"CompressedRecord: metadata has no {key!r} entry (not a record written by to_safetensors_dict)")
        header = json.loads(metadata[key])
        mine = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix) and k[len(prefix):] in _POOLS}
        rec = cls(header, mine)
        rec.validate()
        return rec

    def to_bytes(self) -> bytes:
        from safetensors.torch import save

        tensors, meta = self.to_safetensors_dict()
        return save({k: _owned_cpu(v) for k, v in tensors.items()}, metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes) -> "CompressedRecord":
        return unpack_records(data)[0][0]

    # -- checks and decoding -------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError unless header and tensors are consistent (cheap: no data scan)."""
        h, op = self.header, "CompressedRecord"
        if not isinstance(h, dict) or h.get("format") != RECORD_FORMAT:
            raise ValueError(f"{op}: header format is {h.get('format') if isinstance(h, dict) else h!r}, expected {RECORD_FORMAT!r}")
        for name, t in self.tensors.items():
            if name not in _POOLS:
                raise ValueError(f"{op}: unexpected tensor {name!r}")
            if t.dtype != _POOLS[name] or t.dim() != 1:
                raise ValueError(f"{op}: tensor {name!r} must be 1-D {_POOLS[name]}, got {t.dtype} {tuple(t.shape)}")
        sizes = {k: self.tensors[k].numel() if k in self.tensors else 0 for k in _POOLS}

        def need(pool: str, start: int, count: int, seg: int) -> None:
            if start < 0 or count < 0 or start + count > sizes[pool]:
                raise ValueError(f"{op}: segment {seg} needs {pool}[{start}:{start + count}] but it has {sizes[pool]} elements")

        pos = 0
        n = int(h["n"])
        bs = int(h.get("block_size", DEFAULT_BLOCK_SIZE))
        for i, seg in enumerate(h["segments"]):
            off, numel, codec = int(seg["offset"]), int(seg["numel"]), seg["codec"]
            if off != pos or numel < 0:
                raise ValueError(f"{op}: segment {i} starts at {off}, expected {pos} (segments must tile [0, n))")
            if codec == "int8":
                need("int8_codes", int(seg["codes_start"]), numel, i)
                need("int8_scales", int(seg["scales_start"]), (numel + bs - 1) // bs, i)
            elif codec in ("bf16", "fp32"):
                need(f"{codec}_values", int(seg["start"]), numel, i)
            elif codec == "topk":
                rel = 0
                for rel_off, length, start, count in seg["chunks"]:
                    if rel_off != rel or length < 0 or length > TOPK_CHUNK_ELEMS:
                        raise ValueError(f"{op}: segment {i} has a malformed top-k chunk list")
                    need("topk_values", start, count, i)
                    need("topk_indices", start, count, i)
                    rel += length
                if rel != numel:
                    raise ValueError(f"{op}: segment {i}'s top-k chunks cover {rel} of {numel} elements")
            else:
                raise ValueError(f"{op}: segment {i} has unknown codec {codec!r}")
            pos += numel
        if pos != n:
            raise ValueError(f"{op}: segments cover {pos} elements but the header says n={n}")

    def pieces(self) -> list[tuple]:
        """The record as the native ops' piece list ``(kind, offset, numel, param, t0, t1)``."""
        t = self.tensors
        empty = torch.empty(0, device=self.device)
        bs = int(self.header.get("block_size", DEFAULT_BLOCK_SIZE))
        out: list[tuple] = []
        for seg in self.header["segments"]:
            off, numel, codec = int(seg["offset"]), int(seg["numel"]), seg["codec"]
            if codec == "int8":
                cs, ss = int(seg["codes_start"]), int(seg["scales_start"])
                nb = (numel + bs - 1) // bs
                out.append((PIECE_INT8, off, numel, bs, t["int8_codes"][cs : cs + numel] if numel else empty.to(torch.int8),
                            t["int8_scales"][ss : ss + nb] if nb else empty))
            elif codec == "topk":
                for rel, length, start, count in seg["chunks"]:
                    if count:
                        v, i = t["topk_values"][start : start + count], t["topk_indices"][start : start + count]
                    else:
                        v, i = empty.to(torch.float16), empty.to(torch.int32)
                    out.append((PIECE_TOPK, off + rel, length, 0, v, i))
            else:
                s = int(seg["start"])
                dt = torch.bfloat16 if codec == "bf16" else torch.float32
                v = t[f"{codec}_values"][s : s + numel] if numel else empty.to(dt)
                out.append((_CODEC_KIND[codec], off, numel, 0, v, empty))
        return out


def pack_records(records: Sequence[CompressedRecord], metadata: Optional[dict[str, str]] = None) -> bytes:
    """Serialize N records (a diff batch) into one safetensors blob; ``metadata`` is stored alongside."""
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    meta = dict(metadata or {})
    meta["megatier_records"] = str(len(records))
    seen: set[tuple[int, int]] = set()
    for i, rec in enumerate(records):
        t, m = rec.to_safetensors_dict(prefix=f"r{i}.")
        for k, v in t.items():
            v = _owned_cpu(v)
            key = v.untyped_storage().data_ptr()
            if key in seen:
                v = v.clone()  # safetensors refuses tensors that share memory
            seen.add(key)
            tensors[k] = v
        meta.update(m)
    return save(tensors, metadata=meta)


def _owned_cpu(v: torch.Tensor) -> torch.Tensor:
    """A CPU tensor that owns its whole storage (safetensors refuses views into bigger buffers)."""
    v = v.cpu()
    if v.storage_offset() != 0 or v.untyped_storage().nbytes() != v.numel() * v.element_size():
        v = v.clone()
    return v


def unpack_records(data: bytes) -> tuple[list[CompressedRecord], dict[str, str]]:
    """Inverse of :func:`pack_records` (also reads :meth:`CompressedRecord.to_bytes`)."""
    from safetensors.torch import load

    tensors = load(data)
    meta = _safetensors_metadata(data)  # safetensors.torch.load does not return the metadata
    if "megatier_records" in meta:
        count = int(meta["megatier_records"])
        recs = [CompressedRecord.from_safetensors_dict(tensors, meta, prefix=f"r{i}.") for i in range(count)]
    else:
        recs = [CompressedRecord.from_safetensors_dict(tensors, meta)]
    return recs, meta


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    if len(data) < 8:
        raise ValueError("not a safetensors blob (too short)")
    hlen = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + hlen])
    return dict(header.get("__metadata__", {}))


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
                raise TypeError(f"{op}: segments[{i}] must be an (offset, numel) pair or have .offset and .numel, got {seg!r}") from None
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
) -> CompressedRecord:
    """Compress a flat fp32 gradient shard per parameter segment into one :class:`CompressedRecord`.

    ``segments``: shard-local ``(offset, numel)`` pairs (or objects with ``.offset``/``.numel``)
    tiling ``flat`` in order; ``None`` means one segment. ``mode``: ``"adaptive"`` (INT8 for
    segments below ``small_threshold`` elements, top-k at ``ratio`` from it up), ``"int8"``,
    ``"topk"``, or lossless ``"bf16"`` / ``"fp32"``.
    """
    op = "compress_segments"
    check_flat(flat, op, "flat")
    if mode not in MODES:
        raise ValueError(f"{op}: mode must be one of {MODES}, got {mode!r}")
    ratio = _check_ratio(ratio, op)
    small_threshold = _check_int(small_threshold, op, "small_threshold", 0)
    block_size = _check_int(block_size, op, "block_size", 1)
    sample_size = _check_int(sample_size, op, "sample_size", 1)
    seed = _check_int(seed, op, "seed", -(2**63), 2**64 - 1)
    chunk_size = _check_int(chunk_size, op, "chunk_size", 1, TOPK_CHUNK_ELEMS)
    n = flat.numel()
    offsets, numels = _normalize_segments(segments, n, op)
    if mode == "adaptive":
        codecs = ["int8" if k < small_threshold else "topk" for k in numels]
    else:
        codecs = [mode] * len(numels)
    header: dict[str, Any] = {
        "format": RECORD_FORMAT, "mode": mode, "n": n, "ratio": ratio, "small_threshold": small_threshold,
        "block_size": block_size, "sample_size": sample_size, "seed": seed, "chunk_size": chunk_size,
    }

    if flat.device.type == "cpu" and _native.use_native(flat):
        codes, scales, tv, ti, tc, bf, fp = _native.lib().compress_segments(
            flat, offsets, numels, [_CODEC_KIND[c] for c in codecs], ratio, block_size, sample_size, _signed64(seed), chunk_size
        )
        chunk_counts = tc.tolist()
    else:
        pools: dict[str, list[torch.Tensor]] = {k: [] for k in _POOLS}
        chunk_counts = []
        for s, (off, num, codec) in enumerate(zip(offsets, numels, codecs)):
            x = flat[off : off + num]
            if codec == "int8":
                c, sc = quantize_int8(x, block_size)
                pools["int8_codes"].append(c)
                pools["int8_scales"].append(sc)
            elif codec == "topk":
                for ci, start in enumerate(range(0, num, chunk_size)):
                    v, i = _sparsify_chunk(x[start : start + chunk_size], ratio, sample_size, _chunk_seed(seed, s, ci))
                    pools["topk_values"].append(v)
                    pools["topk_indices"].append(i)
                    chunk_counts.append(v.numel())
            elif codec == "bf16":
                pools["bf16_values"].append(x.to(torch.bfloat16))
            else:
                pools["fp32_values"].append(x.clone())

        def cat(name: str) -> torch.Tensor:
            parts = pools[name]
            return torch.cat(parts) if parts else flat.new_empty(0, dtype=_POOLS[name])

        codes, scales, tv, ti, bf, fp = (cat(k) for k in ("int8_codes", "int8_scales", "topk_values", "topk_indices",
                                                           "bf16_values", "fp32_values"))

    segs = []
    cs = ss = ts = bs_ = fs = 0
    chunk_iter = iter(chunk_counts)
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
    header["segments"] = segs
    tensors = {}
    for name, t in (("int8_codes", codes), ("int8_scales", scales), ("topk_values", tv), ("topk_indices", ti),
                    ("bf16_values", bf), ("fp32_values", fp)):
        if t.numel():
            tensors[name] = t
    return CompressedRecord(header, tensors)


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


def iter_pieces(grad: Any, n: int, op: str, what: str) -> list[tuple]:
    """Piece list of a dense gradient or a record, checked against a shard of ``n`` elements."""
    if isinstance(grad, CompressedRecord):
        grad.validate()
        if grad.n != n:
            raise ValueError(f"{op}: {what} is a record of {grad.n} elements but the shard has {n}")
        return grad.pieces()
    check_flat(grad, op, what)
    if grad.numel() != n:
        raise ValueError(f"{op}: {what} has {grad.numel()} elements but the shard has {n}")
    return [(PIECE_FP32, 0, n, 0, grad, grad[:0])]


__all__ = [
    "CompressedRecord", "TopK", "MODES", "RECORD_FORMAT", "TOPK_CHUNK_ELEMS", "DEFAULT_RATIO",
    "DEFAULT_SMALL_THRESHOLD", "DEFAULT_BLOCK_SIZE", "DEFAULT_SAMPLE_SIZE", "quantize_int8", "dequantize_int8",
    "sparsify_topk", "densify", "compress_segments", "decompress_segments", "pack_records", "unpack_records",
]
