"""Where a checkpointing step's time goes: milliseconds by part (the ``ckpt_<part>_ms`` metrics)."""
from __future__ import annotations

import time


class PhaseClock:
    """Milliseconds between laps, by the name of the part that just ended."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self.laps[part] = 1000.0 * (now - self._t)
        self._t = now

    def add_since(self, part: str, start: float) -> None:
        """Add the time since ``start`` (a perf_counter reading after the last lap) to ``part``; the next lap
        starts now."""
        now = time.perf_counter()
        self.laps[part] = self.laps.get(part, 0.0) + 1000.0 * (now - start)
        self._t = now
