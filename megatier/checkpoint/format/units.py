"""Identity of a checkpoint unit and the names every tier derives from it.

A *unit* is what one rank saves as one payload: a base at version v, a diff
batch covering steps first..last (inclusive), or the diff record of one step
of a batch still open (node memory only: it makes the step durable at once and
is deleted when its batch is written). Every tier names a unit the same way, so
an inventory from Tier-1, Tier-2 and Tier-3 can be compared directly::

    base/v00000050            base at version 50
    diff/v00000046-00000050   diff batch of steps 46..50
    step/v00000047            step 47's record, while batch 46..50 is open

Versions are zero-padded to 8 digits so lexicographic order is numeric order
for any run shorter than 10^8 steps.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

BASE = "base"
DIFF = "diff"
STEP = "step"
_DIRNAME = re.compile(r"^(base|step)/v(\d{8})$|^(diff)/v(\d{8})-(\d{8})$")
_RANK = re.compile(r"^rank(\d{5})$")
_TEXT = re.compile(r"^(base|step) v(\d+)$|^diff v(\d+)-(\d+)$")


@dataclass(frozen=True, order=True)
class PayloadId:
    """One unit: ``kind`` is "base" (first == last == version), "diff" (steps first..last) or "step" (one step,
    first == last)."""

    kind: str
    first: int
    last: int

    def __post_init__(self) -> None:
        if self.kind not in (BASE, DIFF, STEP):
            raise ValueError(f"payload kind must be {BASE!r}, {DIFF!r} or {STEP!r}, got {self.kind!r}")
        if not 0 <= self.first <= self.last < 10**8:
            raise ValueError(f"payload range {self.first}..{self.last} must satisfy 0 <= first <= last < 10^8")
        if self.kind != DIFF and self.first != self.last:
            raise ValueError(f"a {self.kind} has one version, got {self.first}..{self.last}")

    @classmethod
    def base(cls, version: int) -> "PayloadId":
        return cls(BASE, version, version)

    @classmethod
    def diff(cls, first: int, last: int) -> "PayloadId":
        return cls(DIFF, first, last)

    @classmethod
    def step(cls, step: int) -> "PayloadId":
        return cls(STEP, step, step)

    @property
    def replays(self) -> bool:
        """Whether the unit holds gradients to replay (a diff batch or a step record), not a base."""
        return self.kind != BASE

    @property
    def version(self) -> int:
        """The state version this unit brings the shard to (the last step it covers)."""
        return self.last

    @property
    def dirname(self) -> str:
        if self.kind == DIFF:
            return f"diff/v{self.first:08d}-{self.last:08d}"
        return f"{self.kind}/v{self.last:08d}"

    @classmethod
    def from_dirname(cls, name: str) -> Optional["PayloadId"]:
        """Parse ``base/vNNNNNNNN``, ``step/vNNNNNNNN`` or ``diff/vNNNNNNNN-NNNNNNNN``; None for anything else."""
        m = _DIRNAME.match(name)
        if m is None:
            return None
        if m.group(1):
            return cls(m.group(1), int(m.group(2)), int(m.group(2)))
        first, last = int(m.group(4)), int(m.group(5))
        return cls.diff(first, last) if first <= last else None

    def to_dict(self) -> dict:
        return {"kind": self.kind, "first": self.first, "last": self.last}

    @classmethod
    def from_dict(cls, d: dict) -> "PayloadId":
        return cls(str(d["kind"]), int(d["first"]), int(d["last"]))

    def __str__(self) -> str:
        return f"diff v{self.first}-{self.last}" if self.kind == DIFF else f"{self.kind} v{self.last}"

    @classmethod
    def parse(cls, text: str) -> "PayloadId":
        """Inverse of ``str()``: ``base v8``, ``step v9`` or ``diff v9-10``; ValueError for anything else."""
        m = _TEXT.match(text)
        if m is None:
            raise ValueError(f"{text!r} is not a unit (expected 'base vN', 'step vN' or 'diff vA-B')")
        if m.group(1):
            return cls(m.group(1), int(m.group(2)), int(m.group(2)))
        return cls.diff(int(m.group(3)), int(m.group(4)))


def rank_name(rank: int) -> str:
    """``rank00003``: the rank part of every per-rank name."""
    if not 0 <= rank < 10**5:
        raise ValueError(f"rank {rank} out of range [0, 99999]")
    return f"rank{rank:05d}"


def parse_rank_name(name: str) -> Optional[int]:
    """Inverse of :func:`rank_name`; None for anything else."""
    m = _RANK.match(name)
    return int(m.group(1)) if m else None


def check_path_component(value: str, what: str) -> str:
    """Reject names that would escape or split a directory (``/``, ``..``, empty)."""
    if not value or "/" in value or "\\" in value or value in (".", "..") or "\0" in value:
        raise ValueError(f"{what}={value!r} cannot be used as a directory name; use a plain name")
    return value
