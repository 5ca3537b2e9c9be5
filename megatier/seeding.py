"""Deterministic seed derivation: one root seed, independent streams per purpose and rank."""
from __future__ import annotations

import xxhash


def derive_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed that depends only on ``seed`` and ``parts`` (e.g. a parameter name, a rank)."""
    key = ":".join(map(str, (seed, *parts))).encode()
    return xxhash.xxh64_intdigest(key) & ((1 << 63) - 1)
