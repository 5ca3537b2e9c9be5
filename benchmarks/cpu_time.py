"""CPU time of a benchmark run, split into the checkpoint helpers', the loop's checkpoint work and training.

CPU seconds are what a run consumed, not how long it waited for a core, so other tenants of a
shared box move them far less than wall time (through shared caches and cores only). Every clock
below counts user+system time at nanosecond resolution: time.process_time() for the whole process
(every thread, ended ones included), time.thread_time() and the Linux per-thread CPU clock for one
thread.
"""
from __future__ import annotations

import os
import threading
import time


def _thread_clock_s(native_id: int) -> float:
    """CPU seconds of a live thread of this process (Linux: the clock id of MAKE_THREAD_CPUCLOCK(tid, SCHED)).

    Unlike pthread_getcpuclockid it is safe after the thread ended: the kernel then answers EINVAL (OSError).
    """
    return time.clock_gettime(((~native_id) << 3) | 6)


def threads_cpu_s(threads, final: dict, read=_thread_clock_s) -> float:
    """Sum of the CPU seconds each thread has used so far: its ``final`` figure once its run() returned,
    else a read of its live clock. The sum only grows, so the difference of two sums is the CPU all the
    threads used in between, those that started or ended in between included."""
    total = 0.0
    for t in list(threads):
        cpu = final.get(t)
        if cpu is None:
            try:
                cpu = read(t.native_id)
            except OSError:  # ended after the lookup above: its final figure is in by now
                cpu = final.get(t, 0.0)
        total += cpu
    return total


class HelperThreads:
    """Tracks every Python thread started while active: the checkpointer's or baseline's helpers.

    Thread.start is wrapped so each new thread's run() records the thread's own CPU clock as it returns;
    a helper that starts and ends between two samples (a persist-<step> thread, a pool worker) is thus
    counted in full. Native threads a helper spawns (an OpenMP team of its own) are not seen here, so
    their CPU counts as training; the process CPU against ``none`` still includes it.
    """

    def __init__(self):
        self.threads: list[threading.Thread] = []
        self.final: dict[threading.Thread, float] = {}

    def cpu_s(self) -> float:
        return threads_cpu_s(self.threads, self.final)

    def __enter__(self):
        self._start = start = threading.Thread.start
        threads, final = self.threads, self.final

        def tracked_start(thread, *args, **kwargs):
            run = thread.run

            def tracked_run():
                try:
                    run()
                finally:
                    final[thread] = time.thread_time()

            thread.run = tracked_run
            start(thread, *args, **kwargs)  # returns once the thread runs: native_id is set
            threads.append(thread)

        threading.Thread.start = tracked_start
        return self

    def __exit__(self, *exc):
        threading.Thread.start = self._start


def loop_threads(helpers: HelperThreads) -> list[int]:
    """Native ids of this process's threads that are not helpers: the loop's thread, its OpenMP team, gloo's."""
    started = {t.native_id for t in helpers.threads}
    return [tid for tid in map(int, os.listdir("/proc/self/task")) if tid not in started]


def threads_by_id_cpu_s(tids: list[int], read=_thread_clock_s) -> float:
    """Sum of the live threads' CPU clocks (a thread that has ended is left out)."""
    total = 0.0
    for tid in tids:
        try:
            total += read(tid)
        except OSError:
            pass
    return total


class CpuMeter:
    """CPU seconds over the measured window (the start of step warmup+1 to the end of the loop).

    Wraps the trainer's train_step (to sample the window's start, outside the step's timing) and the
    checkpointer's after_step: the loop's own checkpoint work is what the non-helper threads (the loop's
    thread and its OpenMP team, listed at the window's start) used inside the hook, each read from its own
    thread clock. Not from the process clock: that one brings only the calling thread's time up to date, so a
    team thread that was spinning on another core before the hook had its spin accounted only when it next
    blocked, i.e. when the hook parked it (up to a scheduler tick of it: ~1 ms per step of the loop's
    training CPU counted as the hook's, on the 2-core box).
    """

    def __init__(self, helpers: HelperThreads, warmup: int):
        self.helpers, self.warmup = helpers, warmup
        self.start = None  # (process, helpers) CPU seconds at the start of step warmup+1
        self.hook_s = 0.0
        self._loop: list[int] = []  # loop_threads() at the window's start

    def instrument(self, trainer) -> None:
        train_step = trainer.train_step

        def timed_step(step: int) -> dict:
            if step == self.warmup + 1:
                self._loop = loop_threads(self.helpers)
                self.start = (time.process_time(), self.helpers.cpu_s())
            return train_step(step)

        trainer.train_step = timed_step
        if trainer.checkpointer is not None:
            after_step = trainer.checkpointer.after_step

            def timed_hook(step: int) -> dict:
                if step <= self.warmup:
                    return after_step(step)
                before = threads_by_id_cpu_s(self._loop)
                out = after_step(step)
                self.hook_s += threads_by_id_cpu_s(self._loop) - before
                return out

            trainer.checkpointer.after_step = timed_hook

    def finish(self, steps: int) -> dict:
        """Call right after the loop: the window's CPU split, per step."""
        process_s = time.process_time() - self.start[0]
        helpers_s = self.helpers.cpu_s() - self.start[1]
        return cpu_split(process_s, helpers_s, self.hook_s, steps)


def cpu_split(process_s: float, helpers_s: float, hook_s: float, steps: int) -> dict:
    """Per-step CPU ms of a window: process = helpers (a) + in-hook checkpoint work (b) + training (the rest),
    and the checkpoint CPU (a + b) as a percentage of the training CPU."""
    training_s = process_s - helpers_s - hook_s
    return {"cpu_ms": 1000.0 * process_s / steps, "helper_cpu_ms": 1000.0 * helpers_s / steps,
            "hook_cpu_ms": 1000.0 * hook_s / steps, "train_cpu_ms": 1000.0 * training_s / steps,
            "ckpt_cpu_pct": 100.0 * (helpers_s + hook_s) / training_s}
