"""Dynamic loss scaling for fp16 training."""
from __future__ import annotations


class DynamicLossScaler:
    """Scale the loss up so fp16 gradients do not underflow; back off on overflow.

    On an overflow (inf/nan in any gradient) the step is skipped; after
    ``hysteresis`` consecutive overflows the scale halves (not below
    ``min_scale``). After ``window`` clean steps in a row it doubles.
    """

    def __init__(self, initial_scale: float, min_scale: float, window: int, hysteresis: int):
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.window = window
        self.hysteresis = hysteresis
        self._hysteresis_left = hysteresis
        self._clean_steps = 0

    def update(self, found_overflow: bool) -> None:
        if found_overflow:
            self._clean_steps = 0
            self._hysteresis_left -= 1
            if self._hysteresis_left <= 0:
                self.scale = max(self.scale / 2.0, self.min_scale)
                self._hysteresis_left = self.hysteresis
            return
        self._clean_steps += 1
        if self._clean_steps >= self.window:
            self.scale *= 2.0
            self._clean_steps = 0
            self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "hysteresis_left": self._hysteresis_left, "clean_steps": self._clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self._hysteresis_left = int(state["hysteresis_left"])
        self._clean_steps = int(state["clean_steps"])
