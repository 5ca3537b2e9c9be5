"""Megatron's time-limited jobs: ``train.exit_interval`` and ``train.exit_duration_in_mins``.

A job under a scheduler's wall-clock limit must stop while it can still make its state durable. Megatron stops
at the first step that ends past ``--exit-duration-in-mins``; here the loop stops after the last step that ends
within it. The check runs inside each step (at its loss all-reduce), so what is left of that step and the whole
next one must fit: the launch's elapsed time plus twice its longest step so far (a base write or an evaluation
included) is compared with the limit. The drain that follows (the open diff batch,
the final base, Tier-3) is not in the estimate: the limit must leave room for it below the scheduler's.

The time is measured from the start of the training process, as a scheduler counts it (Megatron starts its
clock after the imports, which on a loaded machine take seconds). Global rank 0 alone judges it, and the decision
reaches the other ranks with the step's loss all-reduce (:mod:`megatier.training.interrupt`), so every rank stops
after the same step.
"""
from __future__ import annotations

import os
import time
from typing import Optional


def process_start() -> float:
    """This process's start on the time.monotonic() clock (Linux's /proc; elsewhere: now)."""
    try:
        with open("/proc/self/stat") as f:  # field 22, starttime, in clock ticks since boot
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.monotonic() - max(age, 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic()


class TimeLimit:
    """When the loop must stop by ``exit_interval`` (every rank agrees on its own) or ``exit_duration_in_mins``."""

    def __init__(self, exit_interval: Optional[int] = None, exit_duration_in_mins: Optional[float] = None,
                 started: Optional[float] = None):
        self.exit_interval = exit_interval
        self.exit_after_s = None if exit_duration_in_mins is None else 60.0 * exit_duration_in_mins
        self.started = process_start() if started is None else started
        self.longest_step_s = 0.0
        self._seen: Optional[tuple[int, float]] = None  # the newest step asked about, and when it was first

    def interval_due(self, step: int) -> bool:
        """Megatron's --exit-interval: stop after every step that is a multiple of it."""
        return self.exit_interval is not None and step % self.exit_interval == 0

    def duration_due(self, step: int) -> bool:
        """Whether ``step`` is the last that ends within the limit (see the module docstring)."""
        now = time.monotonic()
        if self._seen is None or step != self._seen[0]:
            if self._seen is not None and step == self._seen[0] + 1:  # not across a restore or a build
                self.longest_step_s = max(self.longest_step_s, now - self._seen[1])
            self._seen = (step, now)
        if self.exit_after_s is None:
            return False
        return now - self.started + 2.0 * self.longest_step_s >= self.exit_after_s
