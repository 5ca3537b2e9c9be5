"""CompressedRecord: one compressed gradient shard, self-describing, and its (de)serialization.

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
from typing import Any, Optional, Sequence

import torch

from megatier.ops.codecs import DEFAULT_BLOCK_SIZE, TOPK_CHUNK_ELEMS, check_flat

RECORD_FORMAT = "megatier.grad/1"

# Piece kinds shared with megatier/csrc/common.h.
PIECE_FP32, PIECE_BF16, PIECE_INT8, PIECE_TOPK, PIECE_ZERO = 0, 1, 2, 3, 4
CODEC_KIND = {"fp32": PIECE_FP32, "bf16": PIECE_BF16, "int8": PIECE_INT8, "topk": PIECE_TOPK}
POOLS = {
    "int8_codes": torch.int8,
    "int8_scales": torch.float32,
    "topk_values": torch.float16,
    "topk_indices": torch.int32,
    "bf16_values": torch.bfloat16,
    "fp32_values": torch.float32,
}


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
            raise ValueError(f"CompressedRecord: metadata has no {key!r} entry (not a record written by "
                             "to_safetensors_dict)")
        header = json.loads(metadata[key])
        mine = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix) and k[len(prefix):] in POOLS}
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
            raise ValueError(f"{op}: header format is {h.get('format') if isinstance(h, dict) else h!r}, expected "
                             f"{RECORD_FORMAT!r}")
        for name, t in self.tensors.items():
            if name not in POOLS:
                raise ValueError(f"{op}: unexpected tensor {name!r}")
            if t.dtype != POOLS[name] or t.dim() != 1:
                raise ValueError(f"{op}: tensor {name!r} must be 1-D {POOLS[name]}, got {t.dtype} {tuple(t.shape)}")
        sizes = {k: self.tensors[k].numel() if k in self.tensors else 0 for k in POOLS}

        def need(pool: str, start: int, count: int, seg: int) -> None:
            if start < 0 or count < 0 or start + count > sizes[pool]:
                raise ValueError(f"{op}: segment {seg} needs {pool}[{start}:{start + count}] but it has "
                                 f"{sizes[pool]} elements")

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
                codes = t["int8_codes"][cs : cs + numel] if numel else empty.to(torch.int8)
                out.append((PIECE_INT8, off, numel, bs, codes,
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
                out.append((CODEC_KIND[codec], off, numel, 0, v, empty))
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
