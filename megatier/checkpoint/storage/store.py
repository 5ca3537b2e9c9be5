"""The one small store interface every tier implements, its errors, and retry with backoff.

Keys are '/'-separated relative names (``base/v00000050/rank00003.json``).
Guarantees every implementation gives:

- ``put`` is atomic: a reader sees the old object, no object, or the whole new
  one, never a prefix. A crash mid-put leaves no visible object.
- ``put_if_absent`` is an atomic conditional create: of concurrent callers for
  one key exactly one gets True and its bytes are the object's.
- ``delete`` of a missing key is not an error.
- ``list(prefix)`` returns every complete object whose key starts with prefix.
- ``children(prefix)`` (``prefix`` ending in '/') returns the names one level
  below it that hold keys: ``{"v1"}`` for ``base/v1/a`` under ``base/``. It may
  also name one whose only content is a write in progress.
"""
from __future__ import annotations

import abc
import mmap
import random
import time
from dataclasses import dataclass
from typing import BinaryIO, Callable, Optional, TypeVar, Union

T = TypeVar("T")
# Payload bytes as the tiers pass them: bytes, or a read-only map of a Tier-1 file.
Buffer = Union[bytes, mmap.mmap]


class StoreError(Exception):
    """A store operation failed; ``transient`` says whether trying again later may succeed."""

    transient: bool = False


class ObjectNotFound(StoreError, KeyError):
    """The key does not exist in the store."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class StoreUnavailable(StoreError):
    """The store cannot be reached or used (endpoint down, no bucket, no permission, no credentials)."""

    def __init__(self, message: str, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class TransientStoreError(StoreError):
    """A failure that may go away on retry (timeout, connection reset, throttling, 5xx)."""

    transient = True


class ObjectStore(abc.ABC):
    """Atomic key -> bytes store. ``url`` names the store in messages (directory path or s3://...)."""

    url: str

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Create or replace ``key`` atomically."""

    def put_from(self, key: str, data: Buffer, source: Optional[BinaryIO]) -> None:
        """:meth:`put` of ``data``; ``source``, if given, is an open file holding exactly ``data``
        that a file-system store may copy from in the kernel instead."""
        self.put(key, data)

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if it does not exist; True if this call created it."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """The object's bytes; raises ObjectNotFound."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether ``key`` is a complete object."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> dict[str, int]:
        """Every complete object whose key starts with ``prefix``, mapped to its size in bytes."""

    def children(self, prefix: str) -> set[str]:
        """The names one level below ``prefix`` (which ends in '/') that hold keys; from :meth:`list` here,
        a listing of that one level where the store has one."""
        return {key[len(prefix):].split("/", 1)[0] for key in self.list(prefix) if "/" in key[len(prefix):]}

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is fine."""

    @abc.abstractmethod
    def check(self) -> None:
        """Raise StoreUnavailable naming the URL and what to check unless the store is usable."""

    def describe(self, key: str) -> str:
        """The full location of ``key`` for messages."""
        return f"{self.url.rstrip('/')}/{key}"

    def fail_fast(self) -> "ObjectStore":
        """This store with one attempt per call, for callers that retry on their own (the uploader, the
        coordinator, the lease): a failure then reaches them, and their metrics and shutdown, at once."""
        return self


def check_key(key: str) -> str:
    """Reject keys that are empty, absolute, or step outside the store root."""
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\0" in key:
        raise ValueError(f"invalid store key {key!r}: use relative '/'-separated names without '.' or '..' parts")
    return key


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter: try ``attempts`` times, sleeping up to base*2^i (capped)."""

    attempts: int = 10  # throttling (503 SlowDown) can last seconds: be patient before giving up
    base_delay_s: float = 0.2
    max_delay_s: float = 10.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.base_delay_s < 0 or self.max_delay_s < self.base_delay_s:
            raise ValueError(f"invalid retry policy {self}: need attempts >= 1 and 0 <= base_delay_s <= max_delay_s")

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Sleep before retry number ``attempt`` (0-based): uniform in [0, min(max, base * 2^attempt)]."""
        return rng.uniform(0.0, min(self.max_delay_s, self.base_delay_s * (2.0 ** min(attempt, 30))))


def retry_call(fn: Callable[[], T], policy: RetryPolicy, what: str, *,
               sleep: Callable[[float], None] = time.sleep, rng: Optional[random.Random] = None) -> T:
    """Run ``fn``, retrying transient StoreErrors per ``policy``; other errors propagate at once.

    After the last attempt the transient error is re-raised as StoreUnavailable
    whose message says how many attempts were made for ``what``.
    """
    rng = rng or random.Random()
    for attempt in range(policy.attempts):
        try:
            return fn()
        except StoreError as e:
            if not e.transient:
                raise
            if attempt + 1 == policy.attempts:
                tried = f"{what} failed after {policy.attempts} attempts: " if policy.attempts > 1 else ""
                raise StoreUnavailable(f"{tried}{e}", transient=True) from e
            sleep(policy.delay(attempt, rng))
    raise AssertionError("unreachable: the loop returns or raises")
