"""ops.run_with_team_parked: fn runs on the calling thread, the rest of its OpenMP team sleeps meanwhile."""
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from megatier import ops

pytestmark = pytest.mark.skipif(not ops.native_available(), reason="needs the native extension")


def _other_threads_cpu_s() -> float:
    """CPU seconds used so far by every thread of this process but the calling one (Linux thread clocks)."""
    me = threading.get_native_id()
    total = 0.0
    for tid in map(int, os.listdir("/proc/self/task")):
        if tid != me:
            try:
                total += time.clock_gettime(((~tid) << 3) | 6)
            except OSError:  # ended meanwhile
                pass
    return total


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_fn_runs_on_the_calling_thread_and_its_result_comes_back():
    caller = threading.get_native_id()
    assert ops.run_with_team_parked(lambda: (threading.get_native_id(), "done")) == (caller, "done")


def test_an_exception_in_fn_reaches_the_caller_unchanged():
    class Boom(Exception):
        pass

    with pytest.raises(Boom, match="inside"):
        ops.run_with_team_parked(lambda: (_ for _ in ()).throw(Boom("raised inside")))
    assert ops.run_with_team_parked(lambda: 7) == 7  # the team is usable afterwards


def test_torch_ops_inside_run_on_the_caller_and_compute_the_same():
    x = torch.arange(1_000_000, dtype=torch.float64)
    assert ops.run_with_team_parked(lambda: float(x.sum())) == float(x.sum())
    with ops.thread_parallelism(1):  # a team of one: plain fn()
        assert ops.run_with_team_parked(lambda: ops.run_with_team_parked(lambda: 3)) == 3  # nested


_PARKED_CPU = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from megatier import ops
from tests.unit.ops.test_team import _busy, _other_threads_cpu_s
x = torch.randn(2_000_000)
used = 0.0
for _ in range(20):
    x.add_(1.0)  # a parallel region of the whole team: its other threads are spinning when it ends
    before = _other_threads_cpu_s()
    ops.run_with_team_parked(lambda: _busy(0.005))
    used += _other_threads_cpu_s() - before
print(json.dumps(used))
"""


@pytest.mark.skipif(torch.get_num_threads() < 2 or (os.cpu_count() or 1) < 2, reason="needs a team of 2+ threads")
def test_the_other_team_threads_use_no_cpu_while_fn_runs():
    """Right after a parallel op libgomp's idle team threads spin for milliseconds; parked, they sleep. Measured
    in a process of its own, whose only other threads are the team (a test worker's process also runs other
    tests' helper threads), on a box that is not oversubscribed (skipped otherwise: see below)."""
    if os.getloadavg()[0] > (os.cpu_count() or 1):
        # More runnable threads than cores (the test suite's other worker running a multi-process drill): the
        # team threads are descheduled mid-spin and park late, and CPU time no longer tells parked from spinning.
        pytest.skip(f"load average {os.getloadavg()[0]:.1f} exceeds the {os.cpu_count()} cores")
    section_s, rounds = 0.005, 20
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.run([sys.executable, "-c", _PARKED_CPU, repo], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads())))
    assert proc.returncode == 0, proc.stderr[-2000:]
    used = float(proc.stdout.strip().splitlines()[-1])
    assert used < 0.25 * section_s * rounds, f"other threads used {used * 1e3:.1f} ms in {rounds} parked sections"
