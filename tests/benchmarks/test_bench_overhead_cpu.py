"""CPU time (benchmarks/cpu_time.py, bench_overhead.py): helpers' CPU (ended ones too), the split, the table."""
from __future__ import annotations

import threading
import time

import pytest

from benchmarks import bench_overhead as bo
from benchmarks import cpu_time as ct


def _burn(cpu_s: float) -> None:
    """Use ``cpu_s`` seconds of this thread's CPU."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


class _Fake:
    def __init__(self, native_id):
        self.native_id = native_id


def test_threads_cpu_prefers_the_final_figure_and_reads_live_threads():
    live, ended, gone = _Fake(11), _Fake(12), _Fake(13)
    clocks = {11: 0.25}

    def read(tid):
        if tid not in clocks:
            raise OSError(22, "Invalid argument")  # the kernel's answer for an ended thread
        return clocks[tid]

    assert ct.threads_cpu_s([live, ended, gone], {ended: 0.5}, read) == pytest.approx(0.75)
    # A thread that ends between the lookup of its final figure and the read of its clock.
    final = {}

    def read_then_end(tid):
        final[gone] = 0.125
        raise OSError(22, "Invalid argument")

    assert ct.threads_cpu_s([gone], final, read_then_end) == pytest.approx(0.125)


def test_thread_clock_reads_a_live_thread_and_refuses_an_unknown_one():
    stop = threading.Event()
    t = threading.Thread(target=lambda: (_burn(0.05), stop.wait()))
    t.start()
    try:
        deadline = time.monotonic() + 30.0
        while ct._thread_clock_s(t.native_id) < 0.05 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ct._thread_clock_s(t.native_id) >= 0.05
        assert ct._thread_clock_s(threading.get_native_id()) == pytest.approx(time.thread_time(), abs=0.05)
    finally:
        stop.set()
        t.join()
    with pytest.raises(OSError):
        ct._thread_clock_s(4_194_303)  # no such thread in this process (pid_max's top), or in any


def test_helper_threads_count_threads_that_start_and_end_between_two_samples():
    original = threading.Thread.start
    with ct.HelperThreads() as helpers:
        before = threading.Thread(target=_burn, args=(0.05,))
        before.start()
        before.join()
        start = helpers.cpu_s()
        short = threading.Thread(target=_burn, args=(0.1,), name="persist-1")  # lives between two samples
        short.start()
        short.join()
        end = helpers.cpu_s()
    assert threading.Thread.start is original  # restored on exit: later threads are not tracked
    assert end - start == pytest.approx(0.1, abs=0.03)  # the ended thread before the window cancels out
    assert helpers.threads == [before, short]
    untracked = threading.Thread(target=_burn, args=(0.01,))
    untracked.start()
    untracked.join()
    assert helpers.threads == [before, short]


def test_cpu_split_subtracts_helpers_and_hook_from_the_process():
    # 10 steps: 1.0 s of process CPU, 0.05 s of it helper threads, 0.03 s the loop inside after_step.
    s = ct.cpu_split(process_s=1.0, helpers_s=0.05, hook_s=0.03, steps=10)
    assert s["cpu_ms"] == pytest.approx(100.0)
    assert s["helper_cpu_ms"] == pytest.approx(5.0)
    assert s["hook_cpu_ms"] == pytest.approx(3.0)
    assert s["train_cpu_ms"] == pytest.approx(92.0)
    assert s["ckpt_cpu_pct"] == pytest.approx(100.0 * 0.08 / 0.92)


class _Trainer:
    """Three steps of 50 ms of training CPU, each followed by the checkpointer's hook."""

    def __init__(self, checkpointer):
        self.checkpointer = checkpointer

    def train_step(self, step):
        _burn(0.05)
        return {"step": step}

    def train(self):
        for step in (1, 2, 3):
            self.train_step(step)
            assert self.checkpointer.after_step(step) == {"ckpt": step}


def _measure(checkpointer) -> dict:
    """The CPU split of steps 2 and 3 of a _Trainer with ``checkpointer``."""
    with ct.HelperThreads() as helpers:
        trainer = _Trainer(checkpointer)
        meter = ct.CpuMeter(helpers, warmup=1)
        meter.instrument(trainer)
        trainer.train()
        return meter.finish(steps=2)


def test_cpu_meter_splits_a_loop_with_a_hook_and_a_helper():
    class Checkpointer:
        def after_step(self, step):
            _burn(0.02)  # the loop's own checkpoint work
            worker = threading.Thread(target=_burn, args=(0.03,))
            worker.start()
            worker.join()  # the loop waits for a helper: its CPU is the helper's, not the hook's
            return {"ckpt": step}

    s = _measure(Checkpointer())
    assert s["helper_cpu_ms"] == pytest.approx(30.0, abs=8.0)
    assert s["hook_cpu_ms"] == pytest.approx(20.0, abs=8.0)
    assert s["train_cpu_ms"] == pytest.approx(50.0, abs=10.0)
    assert s["cpu_ms"] == pytest.approx(s["helper_cpu_ms"] + s["hook_cpu_ms"] + s["train_cpu_ms"])


def _run(row, step_s, cpu_ms, ckpt_pct, seq):
    return {"row": row, "mean_step_s": step_s, "mean_stall_ms": 0.5, "max_stall_ms": 2.0, "shard_state_bytes": 1000,
            "seq": seq, "cpu_ms": cpu_ms, "helper_cpu_ms": cpu_ms * ckpt_pct / 200, "hook_cpu_ms": 0.0,
            "train_cpu_ms": cpu_ms, "ckpt_cpu_pct": ckpt_pct}


def test_summary_pairs_cpu_with_the_neighbouring_none_runs():
    runs = [_run("none", 1.0, 100.0, 0.0, 0), _run("sync_torch_save@1", 1.3, 115.0, 12.0, 1),
            _run("none", 1.1, 110.0, 0.0, 2), _run("sync_torch_save@1", 1.3, 126.0, 14.0, 3),
            _run("none", 1.2, 120.0, 0.0, 4)]
    s = bo.summarize(runs, ["none", "sync_torch_save@1"])
    b = s["sync_torch_save@1"]
    assert b["cpu_overhead_pct_min"] == pytest.approx(100.0 * (115.0 / 105.0 - 1))
    assert b["cpu_overhead_pct_max"] == pytest.approx(100.0 * (126.0 / 115.0 - 1))
    assert b["cpu_ms"] == pytest.approx(120.5)
    assert (b["ckpt_cpu_pct"], b["ckpt_cpu_pct_min"], b["ckpt_cpu_pct_max"]) == pytest.approx((13.0, 12.0, 14.0))
    assert s["none"]["cpu_overhead_pct"] == 0.0 and s["none"]["cpu_ms"] == pytest.approx(110.0)


def test_cpu_verdict_checks_the_two_percent_target_and_the_lowest_process_cpu():
    summary = {
        "none": {"overhead_pct": 0.0, "fastest_pct": 0.0},
        "megatier": {"overhead_pct": 2.0, "fastest_pct": 3.0, "cpu_overhead_pct": 1.5,
                     "ckpt_cpu_pct": 1.8, "ckpt_cpu_pct_min": 1.6, "ckpt_cpu_pct_max": 2.4},
        "sync_torch_save@1": {"overhead_pct": 40.0, "fastest_pct": 38.0, "cpu_overhead_pct": 1.0},
    }
    lines = bo.verdict(summary)
    assert lines[3].startswith("target (CPU): megatier checkpoint CPU 1.80% of training CPU (min..max 1.60..2.40%)")
    assert lines[3].endswith("-> MET")
    assert lines[4].startswith("lowest CPU against the rows checkpointing every step: no")
    summary["megatier"]["ckpt_cpu_pct"] = 2.1
    assert bo.verdict(summary)[3].endswith("-> MISSED")


def test_cpu_table_prints_every_row(capsys):
    runs = [_run("none", 1.0, 100.0, 0.0, 0), _run("megatier", 1.01, 101.0, 1.5, 1), _run("none", 1.0, 100.0, 0.0, 2)]
    runs[1].update(diff="adaptive", tiers=["local"], diff_bytes_per_step=15.0, base_bytes_per_base=1000.0)
    summary = bo.summarize(runs, ["none", "megatier"])
    bo.print_cpu_table(summary, bo.parse_args(["--iters", "20", "--warmup", "5"]))
    out = capsys.readouterr().out
    assert "from the start of step 6 to the end of the loop / 15 steps" in out
    megatier = next(line for line in out.splitlines() if line.startswith("megatier"))
    assert megatier.split()[1:4] == ["101.0", "101.0..101.0", "+1.0%"]
    assert megatier.split()[-2:] == ["1.50%", "1.50..1.50"]


def test_cpu_meter_counts_the_loops_other_threads_in_the_hook_but_not_helpers():
    """A thread of the loop's own (an OpenMP team member: started before the window, not a helper) working
    while the hook runs is the hook's CPU; its work during the steps is training."""
    go, done, stop = threading.Event(), threading.Event(), threading.Event()

    def team_member():
        while not stop.is_set():
            if go.wait(0.01):
                go.clear()
                _burn(0.03)
                done.set()

    member = threading.Thread(target=team_member)
    member.start()  # before HelperThreads: not a helper

    class Checkpointer:
        def after_step(self, step):
            go.set()
            done.wait(10)  # the loop waits for its team member: its CPU is the hook's
            done.clear()
            return {"ckpt": step}

    try:
        s = _measure(Checkpointer())
    finally:
        stop.set()
        member.join()
    assert s["helper_cpu_ms"] == pytest.approx(0.0, abs=2.0)
    assert s["hook_cpu_ms"] == pytest.approx(30.0, abs=8.0)
    assert s["train_cpu_ms"] == pytest.approx(50.0, abs=10.0)
