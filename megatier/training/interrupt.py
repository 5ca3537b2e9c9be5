"""Ctrl-C as a request to stop: finish the step in flight, make the checkpoints durable, exit 130.

The first SIGINT only sets a flag. Every rank's flag travels with the step's loss all-reduce (no extra
collective), so all ranks see the request at the same step, stop after it, and close as at the end of
training: the open diff batch and a final base are written, Tier-3 drained. A second SIGINT more than
:data:`REPEAT_S` later interrupts at once (KeyboardInterrupt); one sooner is the same press arriving
twice (the terminal signals torchrun and its workers, and torchrun forwards what it got).

SIGTERM keeps Python's default (the process ends): launchers and the failure drills use it to stop a job.
"""
from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Optional

REPEAT_S = 1.0


class StopRequest:
    """Whether this process was asked to stop (see the module docstring); ``install`` takes over SIGINT."""

    def __init__(self, announce: bool = False):
        self.requested_at: Optional[float] = None
        self.announce = announce  # print one line when the request arrives (global rank 0)
        self._previous = None

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def install(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._on_signal)
        return self

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def request(self) -> None:
        if self.requested_at is None:
            self.requested_at = time.monotonic()
            if self.announce:
                print("stopping after the step in progress, once the checkpoints are durable (Ctrl-C again to "
                      "stop at once)", file=sys.stderr, flush=True)

    def _on_signal(self, signum, frame) -> None:
        if self.requested_at is not None and time.monotonic() - self.requested_at > REPEAT_S:
            raise KeyboardInterrupt
        self.request()
