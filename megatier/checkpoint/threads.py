"""Helper threads of the checkpoint system, kept off the training loop's cores.

On a GPU node the save path runs on side streams and spare host cores; on a CPU
box every core is busy with the loop's own OpenMP team. There, a helper thread
that compresses or hashes with a full OpenMP team of its own oversubscribes the
cores, and the loop's team then waits at every barrier for a descheduled
member: a few milliseconds of helper work cost tens of milliseconds of step
time. So every helper thread

* starts parallel regions (our kernels, ATen ops) with one thread only, and
* runs at a lower CPU priority (nice +5 on Linux, per thread), so the loop's
  threads win the cores when both want them.

Only mildly lower: at nice +19 a helper got so small a share on a loaded host
(several jobs per core, as in the test suite) that Tier-2 transfers missed
their pacing deadline and the loop had to flush synchronously. Whenever the
loop waits for a helper (the Tier-2 hand-off, the memory budget) the cores are
idle and the helper runs at full speed anyway.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Callable

from megatier import ops

log = logging.getLogger(__name__)

HELPER_NICENESS = 5


def demote_current_thread() -> None:
    ops.limit_thread_parallelism(1)
    try:
        # On Linux the nice value is a property of each thread (tid), not of the whole process.
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), HELPER_NICENESS))
    except (AttributeError, OSError) as e:  # not Linux/POSIX, or not permitted: only slower, still correct
        log.debug("could not lower the priority of %s: %s", threading.current_thread().name, e)


def helper_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """A daemon thread (not yet started) that demotes itself, then runs ``target``."""

    def run() -> None:
        demote_current_thread()
        target()

    return threading.Thread(target=run, name=name, daemon=True)
