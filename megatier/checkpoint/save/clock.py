"""Where a checkpointing step's time goes: milliseconds by part (the ``ckpt_<part>_ms`` metrics)."""
from __future__ import annotations

import time

from megatier import ops


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

    def parked(self, fn):
        """``fn()`` with the rest of the loop's team asleep (:func:`~megatier.ops.run_with_team_parked`); the
        wait for the team to wake and leave the region afterwards (a core must be free for it) is the ``unpark``
        part."""
        ended = []

        def run():
            out = fn()
            ended.append(time.perf_counter())
            return out

        out = ops.run_with_team_parked(run)
        self.add_since("unpark", ended[0])
        return out
