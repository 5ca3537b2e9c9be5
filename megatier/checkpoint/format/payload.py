"""Checkpoint payloads: one rank's base or diff batch as safetensors bytes, plus its stamp.

A payload is serialized once, straight into its Tier-1 file when there is a
Tier-1 (else to bytes), and the same bytes go to every tier. Its
:class:`Stamp` is stored beside it (a Tier-1 JSON file, a Tier-3 done marker
and commit record) and carries the xxh64 of those
exact bytes, their size, the job id and the layout. The safetensors metadata
(key ``"megatier"``, one JSON string) repeats the job id, the layout and the
unit, so a payload separated from its stamp still says whose it is.

Base payload tensors: ``master``, ``exp_avg``, ``exp_avg_sq`` (flat fp32 shard,
shape (shard_size,)) and ``rng/<name>`` (RNG state tensors, e.g. the uint8
tensor of ``torch.get_rng_state()``). Metadata: version, Adam step count,
LR-schedule, loss-scaler and data-position state, the shard segment table, and
CheckFree's scalars: the rank's part of the last step's squared gradient norm,
the lr factor and the step since which the state is not exact (absent in older
payloads: none, 1.0, none).

Diff batch tensors: ``s<step>/<name>`` for each step's compressed record.
Metadata per step: step, lr, adam_step, skipped, the rank's part of the step's
squared gradient norm, the record's JSON header and its tensor names (a step may
have none, e.g. a skipped fp16 step).

Checksums are verified where bytes are read from a tier (the tier loaders call
:func:`verify_payload`); :func:`decode_base` and :func:`decode_diff_batch`
check identity (job id, layout, unit) against the stamp and the caller, and
that every value is finite (:mod:`.finite`).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO, ClassVar, Optional, Sequence

import safetensors.torch
import torch
import xxhash

from megatier.checkpoint.format.finite import nonfinite
from megatier.checkpoint.format.units import BASE, DIFF, STEP, PayloadId
from megatier.checkpoint.storage.store import Buffer
from megatier.parallel.layout import Layout

FORMAT = 1
_META_KEY = "megatier"
_STATE_TENSORS = ("master", "exp_avg", "exp_avg_sq")


class PayloadError(Exception):
    """A payload or its stamp is corrupt, truncated, or belongs to another job, layout or unit."""


def checksum(data: bytes) -> str:
    """xxh64 of ``data`` as 16 hex digits (hex, not int: JSON readers lose integers above 2^53)."""
    return xxhash.xxh64(data).hexdigest()


class JsonRecord:
    """``to_json``/``from_json`` of a record class with ``to_dict`` and ``from_dict(d, source)``.

    Unparsable bytes raise the class's error naming the source, what the record
    is and the fix: ``json_errors = (what, error class, fix)``.
    """

    json_errors: ClassVar[tuple[str, type, str]]

    def to_json(self) -> bytes:
        return json.dumps(self.to_dict(), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, source: str):
        what, error, fix = cls.json_errors
        try:
            d = json.loads(data)
        except (UnicodeDecodeError, ValueError) as e:
            raise error(f"{source}: {what} is not valid JSON ({e}); {fix}") from e
        if not isinstance(d, dict):
            raise error(f"{source}: {what} is not a JSON object; {fix}")
        return cls.from_dict(d, source)


@dataclass(frozen=True)
class Stamp(JsonRecord):
    """What is stored beside a payload: its unit, size, xxh64, job id, layout and config fingerprint."""

    pid: PayloadId
    size: int
    xxh64: str
    job_id: str
    layout: Layout
    fingerprint: str = ""  # fingerprint_hash of the config that wrote it ("": written without one)
    json_errors = ("stamp", PayloadError, "the copy is unusable, delete it or recover from another tier")

    @property
    def rank(self) -> int:
        return self.layout.rank

    def to_dict(self) -> dict:
        return {"format": FORMAT, **self.pid.to_dict(), "size": self.size, "xxh64": self.xxh64,
                "job_id": self.job_id, "layout": self.layout.to_dict(), "fingerprint": self.fingerprint}

    @classmethod
    def from_dict(cls, d: dict, source: str) -> "Stamp":
        try:
            if int(d["format"]) != FORMAT:
                raise PayloadError(f"{source}: stamp format {d['format']} is not {FORMAT}; it was written by "
                                   f"another MegaTier version")
            return cls(PayloadId.from_dict(d), int(d["size"]), str(d["xxh64"]), str(d["job_id"]),
                       Layout.from_dict(d["layout"]), str(d.get("fingerprint", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise PayloadError(f"{source}: malformed stamp ({type(e).__name__}: {e}); the copy is unusable, "
                               f"delete it or recover from another tier") from e



@dataclass(frozen=True)
class EncodedPayload:
    """Serialized payload bytes and their stamp; the unit every tier stores and moves.

    ``data`` is ``bytes``, or a read-only ``mmap`` of the Tier-1 file the
    payload was serialized into (the bytes Tier-2 and Tier-3 then send); both
    slice, hash and write alike. The map stays valid after the file is
    deleted or replaced (it holds the old pages until it is dropped).
    """

    data: Buffer
    stamp: Stamp
    # The open Tier-1 file ``data`` maps, if any: a file-system Tier-3 copies from it in the kernel.
    source: Optional[BinaryIO] = field(default=None, compare=False, repr=False)

    @property
    def mapped(self) -> bool:
        return not isinstance(self.data, bytes)

    def detached(self) -> "EncodedPayload":
        """The same payload as ``bytes``, holding no file (a map and its file cost a descriptor each)."""
        return EncodedPayload(bytes(self.data), self.stamp) if self.mapped else self


def verify_payload(data: bytes, stamp: Stamp, source: str) -> None:
    """Raise PayloadError unless ``data`` has the size and xxh64 that ``stamp`` records."""
    if len(data) != stamp.size:
        raise PayloadError(f"{source}: size {len(data)} bytes, stamp says {stamp.size}; the copy is truncated "
                           f"or overwritten, recover {stamp.pid} of rank {stamp.rank} from another tier")
    got = checksum(data)
    if got != stamp.xxh64:
        raise PayloadError(f"{source}: xxh64 {got} does not match the recorded {stamp.xxh64}; the copy is "
                           f"corrupt, recover {stamp.pid} of rank {stamp.rank} from another tier")


@dataclass
class BaseState:
    """One rank's full optimizer shard at ``version`` (the state right after step ``version``)."""

    version: int
    adam_steps: int
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    schedule: dict
    loss_scaler: Optional[dict]
    data_position: dict
    rng: dict[str, torch.Tensor] = field(default_factory=dict)
    segments: list[dict] = field(default_factory=list)
    grad_sumsq: Optional[float] = None  # this rank's part of step ``version``'s squared gradient norm
    lr_scale: float = 1.0  # the optimizer's factor on the schedule's lr
    inexact_since: Optional[int] = None  # the step a last-resort recovery (CheckFree) rebuilt a stage at


@dataclass
class DiffStep:
    """One step's compressed gradient record (``tensors`` + JSON ``header``) and its replay scalars."""

    step: int
    lr: float
    adam_step: int
    skipped: bool
    tensors: dict[str, torch.Tensor]
    header: dict
    grad_sumsq: Optional[float] = None  # this rank's part of the step's squared gradient norm (None: skipped)


def _host(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor; a meta tensor (a size plan's: dtype and shape, no data) stays as it is."""
    return t if t.is_meta else t.detach().cpu().contiguous()


# safetensors' dtype names (its format spec) for the dtypes payloads carry.
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (little-endian, as safetensors stores them)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@dataclass(frozen=True)
class PayloadDraft:
    """A payload's tensors and metadata, not yet serialized: to bytes, or piece by piece into a file.

    The pieces are a safetensors file (8-byte header length, JSON header padded
    to 8 bytes, then each tensor's bytes in header order; safetensors reads it).
    We emit them ourselves because the library only serializes to a new bytes
    object (holding the GIL for the whole copy: the training loop's Python
    thread stalls meanwhile) or to a path it replaces behind the caller's back;
    written piece by piece into the Tier-1 temp file, each tensor is copied
    once, with the GIL released.
    """

    pid: PayloadId
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    job_id: str
    layout: Layout
    fingerprint: str = ""

    def stamp(self, data) -> Stamp:
        """The stamp of ``data``, this draft's serialized bytes (any buffer)."""
        return Stamp(self.pid, len(data), checksum(data), self.job_id, self.layout, self.fingerprint)

    def stamp_of_pieces(self, pieces: Sequence) -> Stamp:
        """The stamp of this draft's serialized bytes, hashed from :meth:`pieces` as they are (the same xxh64 as
        of their concatenation): the caller hashes what it writes while it is in cache, rather than reading
        back a fresh map of the written file, which first faults in every page of it."""
        digest = xxhash.xxh64()
        size = 0
        for piece in pieces:
            digest.update(piece)
            size += memoryview(piece).nbytes
        return Stamp(self.pid, size, digest.hexdigest(), self.job_id, self.layout, self.fingerprint)

    def header(self) -> bytes:
        """The header piece: its 8-byte length, then the JSON of each tensor's dtype, shape and byte range and the
        metadata, padded to 8 bytes. A function of dtypes and shapes only: a draft of meta tensors has it too."""
        entries: dict[str, Any] = {"__metadata__": self.metadata}
        offset = 0
        for name, t in self.tensors.items():
            if t.dtype not in _ST_DTYPES:
                raise ValueError(f"payload tensor {name} has dtype {t.dtype}, which payloads do not store")
            nbytes = t.numel() * t.element_size()
            entries[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                             "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        header = json.dumps(entries, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)
        return struct.pack("<Q", len(header)) + header

    @property
    def size(self) -> int:
        """Bytes of the serialized payload (its stamp's size), without serializing it."""
        return len(self.header()) + sum(t.numel() * t.element_size() for t in self.tensors.values())

    def pieces(self) -> list:
        """The serialized payload as consecutive buffers: the header, then one view per tensor."""
        return [self.header(), *(_raw_bytes(t) for t in self.tensors.values())]

    def to_payload(self) -> EncodedPayload:
        data = b"".join(self.pieces())
        return EncodedPayload(data, self.stamp(data))


def _draft(pid: PayloadId, tensors: dict[str, torch.Tensor], meta: dict, job_id: str, layout: Layout,
           fingerprint: str) -> PayloadDraft:
    meta = {"format": FORMAT, **pid.to_dict(), "job_id": job_id, "layout": layout.to_dict(),
            "fingerprint": fingerprint, **meta}
    return PayloadDraft(pid, tensors, {_META_KEY: json.dumps(meta)}, job_id, layout, fingerprint)


def draft_base(state: BaseState, *, job_id: str, layout: Layout, fingerprint: str = "") -> PayloadDraft:
    """A base shard ready to serialize; fp32 state tensors must be 1-D and of equal length."""
    shapes = {name: tuple(getattr(state, name).shape) for name in _STATE_TENSORS}
    if len(set(shapes.values())) != 1 or len(shapes["master"]) != 1:
        raise ValueError(f"base state tensors must be 1-D of equal length, got {shapes}")
    tensors = {name: _host(getattr(state, name)) for name in _STATE_TENSORS}
    for name, t in tensors.items():
        if t.dtype != torch.float32:
            raise ValueError(f"base state tensor {name} must be float32, got {t.dtype}")
    tensors.update({f"rng/{name}": _host(t) for name, t in state.rng.items()})
    meta = {"adam_steps": state.adam_steps, "schedule": state.schedule, "loss_scaler": state.loss_scaler,
            "data_position": state.data_position, "segments": state.segments, "rng": sorted(state.rng),
            "grad_sumsq": state.grad_sumsq, "lr_scale": state.lr_scale, "inexact_since": state.inexact_since}
    return _draft(PayloadId.base(state.version), tensors, meta, job_id, layout, fingerprint)


def draft_diff_batch(steps: Sequence[DiffStep], *, job_id: str, layout: Layout, fingerprint: str = "",
                     step_unit: bool = False) -> PayloadDraft:
    """N consecutive steps' records as one diff batch, ready to serialize; ``step_unit``: one step's record as
    its own unit (``step/v…``, node memory only) while its batch is open."""
    if not steps:
        raise ValueError("a diff batch needs at least one step")
    first = steps[0].step
    for i, s in enumerate(steps):
        if s.step != first + i:
            raise ValueError(f"diff batch steps must be consecutive, got {[x.step for x in steps]}")
    tensors: dict[str, torch.Tensor] = {}
    records = []
    for s in steps:
        tensors.update({f"s{s.step}/{name}": _host(t) for name, t in s.tensors.items()})
        records.append({"step": s.step, "lr": s.lr, "adam_step": s.adam_step, "skipped": bool(s.skipped),
                        "grad_sumsq": s.grad_sumsq, "header": s.header, "tensors": sorted(s.tensors)})
    if step_unit and len(steps) != 1:
        raise ValueError(f"a step unit holds one step's record, got steps {[x.step for x in steps]}")
    pid = PayloadId.step(first) if step_unit else PayloadId.diff(first, steps[-1].step)
    return _draft(pid, tensors, {"steps": records}, job_id, layout, fingerprint)


def encode_base(state: BaseState, *, job_id: str, layout: Layout, fingerprint: str = "") -> EncodedPayload:
    """Serialize a base shard to bytes (see :func:`draft_base`)."""
    return draft_base(state, job_id=job_id, layout=layout, fingerprint=fingerprint).to_payload()


def encode_diff_batch(steps: Sequence[DiffStep], *, job_id: str, layout: Layout,
                      fingerprint: str = "") -> EncodedPayload:
    """Serialize N consecutive steps' records to bytes as one diff batch."""
    return draft_diff_batch(steps, job_id=job_id, layout=layout, fingerprint=fingerprint).to_payload()


def read_metadata(data: bytes, source: str) -> dict:
    """The MegaTier metadata embedded in safetensors bytes (header only; tensors are not read)."""
    try:
        if len(data) < 8:
            raise ValueError("shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", data[:8])
        if n > len(data) - 8:
            raise ValueError(f"header length {n} exceeds the {len(data)}-byte payload")
        header = json.loads(bytes(data[8:8 + n]))
        meta = json.loads(header["__metadata__"][_META_KEY])
        if not isinstance(meta, dict):
            raise ValueError("metadata is not a JSON object")
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise PayloadError(f"{source}: not a MegaTier safetensors payload ({e})") from e
    if meta.get("format") != FORMAT:
        raise PayloadError(f"{source}: payload format {meta.get('format')} is not {FORMAT}; it was written by "
                           f"another MegaTier version")
    return meta


def _open(payload: EncodedPayload, kinds: tuple[str, ...], job_id: str, layout: Layout,
          source: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """Metadata and tensors of ``payload`` after checking who and what it is."""
    stamp = payload.stamp
    meta = read_metadata(payload.data, source)
    try:
        pid, owner, shard = PayloadId.from_dict(meta), meta["job_id"], Layout.from_dict(meta["layout"])
    except (KeyError, TypeError, ValueError) as e:
        raise PayloadError(f"{source}: payload metadata lacks its identity ({type(e).__name__}: {e})") from e
    if pid != stamp.pid or pid.kind not in kinds:
        raise PayloadError(f"{source}: holds {pid}, expected a {' or '.join(kinds)} matching its stamp "
                           f"({stamp.pid})")
    for what, got, stamped, want in (("job", owner, stamp.job_id, job_id), ("layout", shard, stamp.layout, layout)):
        if got != want or stamped != want:
            raise PayloadError(f"{source}: belongs to {what} {got} (stamp: {stamped}), expected {want}; it is "
                               f"another run's or rank's checkpoint, check checkpoint.job_id and the layout")
    try:
        data = payload.data if isinstance(payload.data, bytes) else bytes(payload.data)
        tensors = safetensors.torch.load(data)
    except Exception as e:  # safetensors raises its own SafetensorError (not importable as a stable name)
        raise PayloadError(f"{source}: tensor data unreadable ({e})") from e
    return meta, tensors


def _optional_float(value) -> Optional[float]:
    return None if value is None else float(value)


def _optional_int(value) -> Optional[int]:
    return None if value is None else int(value)


def _require_finite(tensors: dict[str, torch.Tensor], source: str) -> None:
    bad = nonfinite(tensors)
    if bad:
        raise PayloadError(f"{source}: {', '.join(bad)} hold NaN or inf although the bytes match their checksum: "
                           f"a poisoned state, not a recovery source")


def decode_base(payload: EncodedPayload, *, job_id: str, layout: Layout, source: str) -> BaseState:
    """Rebuild a BaseState; raises PayloadError naming ``source`` on any mismatch."""
    meta, tensors = _open(payload, (BASE,), job_id, layout, source)
    _require_finite(tensors, source)
    try:
        rng = {name: tensors[f"rng/{name}"] for name in meta["rng"]}
        return BaseState(payload.stamp.pid.version, int(meta["adam_steps"]), tensors["master"], tensors["exp_avg"],
                         tensors["exp_avg_sq"], meta["schedule"], meta["loss_scaler"], meta["data_position"],
                         rng, meta["segments"], _optional_float(meta.get("grad_sumsq")),
                         float(meta.get("lr_scale", 1.0)), _optional_int(meta.get("inexact_since")))
    except (KeyError, TypeError, ValueError) as e:
        raise PayloadError(f"{source}: base payload lacks {e}") from e


def decode_diff_batch(payload: EncodedPayload, *, job_id: str, layout: Layout,
                      source: str) -> list[DiffStep]:
    """Rebuild the batch's (or step unit's) DiffSteps in step order; raises PayloadError naming ``source`` on any
    mismatch."""
    meta, tensors = _open(payload, (DIFF, STEP), job_id, layout, source)
    _require_finite(tensors, source)
    pid = payload.stamp.pid
    try:
        steps = [DiffStep(int(r["step"]), float(r["lr"]), int(r["adam_step"]), bool(r["skipped"]),
                          {name: tensors[f"s{r['step']}/{name}"] for name in r["tensors"]}, r["header"],
                          _optional_float(r.get("grad_sumsq")))
                 for r in meta["steps"]]
    except (KeyError, TypeError, ValueError) as e:
        raise PayloadError(f"{source}: diff batch lacks {e}") from e
    if [s.step for s in steps] != list(range(pid.first, pid.last + 1)):
        raise PayloadError(f"{source}: steps {[s.step for s in steps]} do not cover {pid}")
    return steps
