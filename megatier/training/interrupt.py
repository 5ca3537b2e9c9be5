"""Ctrl-C or SIGTERM as a request to stop: finish the step in flight, make the checkpoints durable, and exit
(130 after Ctrl-C; 0 after SIGTERM, as Megatron's --exit-signal-handler; :mod:`megatier.training.outcome`).

The first SIGINT or SIGTERM only sets a flag. Every rank's flags travel with the step's loss all-reduce (no
extra collective), so all ranks see the request at the same step, stop after it, and close as at the end of
training: the open diff batch and a final base are written, Tier-3 drained. A second signal more than
:data:`REPEAT_S` later interrupts at once (KeyboardInterrupt); one sooner is the same press arriving twice (the
terminal signals torchrun and its workers, and torchrun forwards what it got; a scheduler signals every process
of the job). SIGTERM is what a scheduler sends at a wall-clock limit and what launchers send to stop a job, so
it gets the same clean stop as Ctrl-C (Megatron's --exit-signal-handler, always on).

The same flags carry the time limits of :mod:`megatier.training.time_limit`; :data:`CAUSES` orders them: the
first any rank raised is the agreed cause.
"""
from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Optional

from megatier.training.time_limit import TimeLimit

REPEAT_S = 1.0
SIGNALS = (signal.SIGINT, signal.SIGTERM)
CAUSES = ("SIGINT", "SIGTERM", "train.exit_interval", "train.exit_duration_in_mins")


class StopRequest:
    """Whether this process was asked to stop (see the module docstring); ``install`` takes over SIGINT and
    SIGTERM."""

    def __init__(self, announce: bool = False):
        self.requested_at: Optional[float] = None
        self.signal: Optional[signal.Signals] = None  # the first signal received
        self.announce = announce  # print one line when the request arrives (global rank 0)
        self.limit = TimeLimit()
        self._previous: dict = {}

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def install(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._on_signal) for sig in SIGNALS}
        return self

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def set_limits(self, exit_interval: Optional[int], exit_duration_in_mins: Optional[float]) -> None:
        self.limit = TimeLimit(exit_interval, exit_duration_in_mins, started=self.limit.started)

    def request(self, sig: signal.Signals = signal.SIGINT) -> None:
        if self.requested_at is None:
            self.requested_at, self.signal = time.monotonic(), signal.Signals(sig)
            if self.announce:
                again = "Ctrl-C" if self.signal == signal.SIGINT else self.signal.name
                print(f"{self.signal.name}: stopping after the step in progress, once the checkpoints are durable "
                      f"({again} again to stop at once)", file=sys.stderr, flush=True)

    def flags(self, step: int, decides: bool) -> list[float]:
        """This rank's vote on each of :data:`CAUSES` for ``step``, to be summed over ranks; ``decides``: this rank
        (global rank 0) alone judges the duration, so a clock that differs between ranks cannot split them."""
        duration = self.limit.duration_due(step) and decides
        return [float(self.signal == sig) for sig in SIGNALS] + [float(self.limit.interval_due(step)),
                                                                 float(duration)]

    @staticmethod
    def agreed(votes: list[float]) -> Optional[str]:
        """The cause the ranks stop for, from the summed :meth:`flags` (the same on every rank), or None."""
        return next((cause for cause, vote in zip(CAUSES, votes) if vote > 0), None)

    def _on_signal(self, signum, frame) -> None:
        if self.requested_at is not None and time.monotonic() - self.requested_at > REPEAT_S:
            raise KeyboardInterrupt
        self.request(signum)
