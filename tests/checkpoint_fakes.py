"""Shared builders for checkpoint tests: small payloads of a 2 x 2 job, a store that fails on purpose."""
from __future__ import annotations

import threading

import torch

from megatier.checkpoint.format.payload import BaseState, DiffStep, encode_base, encode_diff_batch
from megatier.checkpoint.storage.store import ObjectStore, RetryPolicy, StoreUnavailable, TransientStoreError
from megatier.parallel.layout import Layout

JOB = "job1"
WORLD = 4
FAST = RetryPolicy(attempts=1, base_delay_s=0.001, max_delay_s=0.01)


def layout(rank: int) -> Layout:
    return Layout(tp=2, pp=1, dp=2, tp_rank=rank % 2, pp_rank=0, dp_rank=rank // 2)


def base(version: int, rank: int, fill: float = 0.0):
    t = torch.arange(8, dtype=torch.float32) + rank + fill
    return encode_base(BaseState(version, version, t, t * 2, t * 3, {}, None, {}), job_id=JOB, layout=layout(rank))


def diff(first: int, last: int, rank: int):
    steps = [DiffStep(s, 1e-3, s, False, {"g": torch.full((3,), float(rank))}, {}) for s in range(first, last + 1)]
    return encode_diff_batch(steps, job_id=JOB, layout=layout(rank))


class FlakyStore(ObjectStore):
    """Delegates to ``inner`` but fails the first ``failures`` writes with a transient error."""

    def __init__(self, inner: ObjectStore, failures: int):
        self.inner, self.url, self.left = inner, inner.url, failures
        self.lock = threading.Lock()

    def _maybe_fail(self, key: str) -> None:
        with self.lock:
            if self.left > 0:
                self.left -= 1
                raise TransientStoreError(f"injected failure writing {key}")

    def put(self, key, data):
        self._maybe_fail(key)
        self.inner.put(key, data)

    def put_if_absent(self, key, data):
        self._maybe_fail(key)
        return self.inner.put_if_absent(key, data)

    def get(self, key):
        return self.inner.get(key)

    def exists(self, key):
        return self.inner.exists(key)

    def list(self, prefix=""):
        return self.inner.list(prefix)

    def delete(self, key):
        self.inner.delete(key)

    def check(self):
        self.inner.check()




class DownAfter(FlakyStore):
    """Delegates to ``inner`` for the first ``ok_writes`` writes, then fails every write as a down endpoint would."""

    def __init__(self, inner: ObjectStore, ok_writes: int):
        super().__init__(inner, 0)
        self.ok = ok_writes

    def _maybe_fail(self, key: str) -> None:
        with self.lock:
            self.ok -= 1
            if self.ok < 0:
                raise TransientStoreError(f"injected outage writing {key}")


class Outage(FlakyStore):
    """Delegates to ``inner``; while ``down`` is set every operation fails as an unreachable endpoint would."""

    def __init__(self, inner: ObjectStore):
        super().__init__(inner, 0)
        self.down = False

    def _maybe_fail(self, key: str) -> None:
        if self.down:
            raise TransientStoreError(f"injected outage at {key}")

    def get(self, key):
        self._maybe_fail(key)
        return self.inner.get(key)

    def list(self, prefix=""):
        self._maybe_fail(prefix)
        return self.inner.list(prefix)

    def delete(self, key):
        self._maybe_fail(key)
        self.inner.delete(key)


class FullAfter(FlakyStore):
    """Delegates to ``inner`` until ``ok_writes`` writes were made, then every write fails as on a full disk."""

    def __init__(self, inner: ObjectStore, ok_writes: int):
        super().__init__(inner, 0)
        self.ok = ok_writes

    def _maybe_fail(self, key: str) -> None:
        with self.lock:
            self.ok -= 1
            if self.ok < 0:
                raise StoreUnavailable(f"writing {key} failed: No space left on device; the file system is full")

    def __getattr__(self, name):  # the node-memory store's extra methods (put_pieces, open_mapped, ...)
        return getattr(self.inner, name)

    def put_pieces(self, key, pieces, reuse=None):
        self._maybe_fail(key)
        self.inner.put_pieces(key, pieces, reuse)
