"""The time a rank spends blocked in communication, by kind, between two reads.

A step's record reports how much of its communication the step could not hide: the data-parallel gradient
reduction after its last backward and the parameter all-gather after the optimizer step (``dp_wait_ms``), the
pipeline's receives (``pp_bubble_ms``). Each module that communicates owns a :class:`WaitClock` and times its
own calls with it; the trainer reads and resets them once per step.

On the CPU (gloo) a blocking collective returns when it is done, so wall time around the call is the time the
rank waited. On a GPU a collective returns once queued: the clock records a CUDA event before and after the
call on the current stream instead (the stream waits for the collective's own stream there), and resolves them
when read, after waiting for the last one: the next forward would wait for it anyway (it needs the gathered
parameters).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch


class WaitClock:
    """Milliseconds spent in timed regions since the last :meth:`take`, summed per kind."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self._ms: dict[str, float] = {}
        self._events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def timing(self, kind: str) -> Iterator[None]:
        """Count the time the body takes (the host's wall time, or on CUDA the stream's) under ``kind``."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((kind, start, end))
            return
        t0 = time.perf_counter()
        yield
        self._ms[kind] = self._ms.get(kind, 0.0) + 1000.0 * (time.perf_counter() - t0)

    def take(self, *kinds: str) -> dict[str, float]:
        """Each of ``kinds``' milliseconds since the last call (0.0 when not timed), and reset."""
        if self._events:
            self._events[-1][2].synchronize()
        for kind, start, end in self._events:
            self._ms[kind] = self._ms.get(kind, 0.0) + start.elapsed_time(end)
        self._events.clear()
        taken = {kind: self._ms.get(kind, 0.0) for kind in kinds}
        self._ms.clear()
        return taken
