"""The loader that keeps the step from waiting on data: step s+1's micro-batches are read and stacked on a
background thread while step s runs.

Reading ahead must not change what is read or what a checkpoint records. The batches of step s are a pure
function of s (:class:`~megatier.data.dataset.BatchSource`), and the position a checkpoint keeps is the step
counter, never this loader's; so a read ahead is only a guess at the next request. A request for the step read
ahead takes its result; any other step (a restore, a rollback, a rerun of a suspicious step, a resharded
restore) is read on the spot and the guess is dropped. Prefetching therefore gives the very same samples as
reading in the loop, whatever the loop asks for.

On CUDA the thread also pins the batches, and the loop copies them to the device without blocking. The
thread is stopped by :meth:`PrefetchingBatches.close` (at the trainer's close and when a recovery leaves the
world) and started again by the next request.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import torch

from megatier.data.sample_log import SampleLog

Batches = list[tuple[torch.Tensor, torch.Tensor]]


class PrefetchingBatches:
    """A BatchSource (``source``) whose training batches are read one step ahead when ``enabled``; every other
    attribute is the source's. ``last_step``: no read ahead past it (train.iters)."""

    def __init__(self, source, device: torch.device, *, enabled: bool = True, last_step: Optional[int] = None):
        self.source = source
        self.device = device
        self.enabled = enabled
        self.last_step = last_step
        self._pin = enabled and device.type == "cuda"
        self._executor: Optional[ThreadPoolExecutor] = None
        self._ahead: Optional[tuple[int, Future]] = None  # (step, its read in flight or done)
        self._wait_s = 0.0
        self._log = SampleLog.from_env()  # MEGATIER_SAMPLE_LOG: what each step consumed, for the exactly-once tests

    def __getattr__(self, name: str):
        if name == "source":  # not set yet (a half-built object): no recursion
            raise AttributeError(name)
        return getattr(self.source, name)

    def train_microbatches(self, step: int) -> Batches:
        """Step ``step``'s micro-batches (on the device when prefetching on CUDA); the time the call took counts
        towards :meth:`take_wait_ms`."""
        start = time.perf_counter()
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == step:
            batches = ahead[1].result()
        else:
            if ahead is not None:
                ahead[1].cancel()  # a guess for another step: let it go
            batches = self._read(step)
        if self._log.enabled:
            self._log.consumed(step, self.source.dp, self.source.dp_rank, self.source.train_indices(step))
        if self.enabled:
            self._read_ahead(step + 1)
        if self._pin:
            batches = [(x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True))
                       for x, y in batches]
        self._wait_s += time.perf_counter() - start
        return batches

    def take_wait_ms(self) -> float:
        """Milliseconds spent waiting for training batches since the last call (a step's ``data_wait_ms``)."""
        waited, self._wait_s = self._wait_s, 0.0
        return 1000.0 * waited

    def close(self) -> None:
        """Stop the thread (waiting for a read in flight); a later request starts it again."""
        self._ahead = None
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def _read(self, step: int) -> Batches:
        batches = self.source.train_microbatches(step)
        if self._pin:
            batches = [(x.pin_memory(), y.pin_memory()) for x, y in batches]
        return batches

    def _read_ahead(self, step: int) -> None:
        if self.last_step is not None and step > self.last_step:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megatier-prefetch")
        self._ahead = (step, self._executor.submit(self._read, step))
