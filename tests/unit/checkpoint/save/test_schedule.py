"""The capture schedule (Checkflow's integer program and Algorithm 1) on synthetic operation profiles."""
from __future__ import annotations

import time

import pytest

from megatier.checkpoint.save.schedule import Chunk, OpProfile, plan, solve, split

pytestmark = pytest.mark.timeout(60)
MIB = 2**20


def _step(ops_per_pass: int = 6, op_ms: float = 10.0, activation_mib: int = 100) -> OpProfile:
    """A step whose forward holds one more activation per op and whose backward frees them again."""
    forward = [(f"fwd {i}", (i + 1) * activation_mib) for i in range(ops_per_pass)]
    backward = [(f"bwd {i}", (ops_per_pass - i) * activation_mib) for i in range(ops_per_pass)]
    names, live = zip(*(forward + backward))
    return OpProfile(tuple(names), tuple(op_ms / 1e3 for _ in names), tuple(m * MIB for m in live))


def _modeled_peak(profile: OpProfile, schedule, bytes_per_element: int) -> int:
    """Recompute the peak from the schedule: live bytes plus every chunk copied so far."""
    held, peak = 0, 0
    for t, live in enumerate(profile.live_bytes):
        held += sum(c.hi - c.lo for c in schedule.at(t)) * bytes_per_element
        peak = max(peak, live + held)
    return peak


def test_a_feasible_schedule_keeps_the_peak_of_the_step_without_checkpointing():
    profile = _step()
    schedule = plan(profile, 50 * MIB // 4, 4, bandwidth=20e9)
    assert schedule is not None and schedule.splits == 0
    assert schedule.peak_bytes == profile.peak_bytes == _modeled_peak(profile, schedule, 4)
    op = schedule.ops[0]
    assert profile.names[op].startswith("bwd")  # copied where the backward has freed enough activations
    # What each op copies fits its duration at the bandwidth.
    for t in set(schedule.ops):
        assert sum(c.hi - c.lo for c in schedule.at(t)) * 4 <= 20e9 * profile.seconds[t]


def test_lower_bandwidth_is_infeasible_whole_and_splitting_restores_it():
    profile = _step()
    size = 50 * MIB
    assert solve(profile, [size], 5e9, memory_limit=profile.peak_bytes, held_on_device=True) is None
    schedule = plan(profile, size // 4, 4, bandwidth=5e9)
    assert schedule is not None and schedule.splits >= 1 and len(schedule.chunks) > 1
    assert schedule.peak_bytes == profile.peak_bytes == _modeled_peak(profile, schedule, 4)
    covered = sorted((c.lo, c.hi) for c in schedule.chunks)  # the chunks tile the part exactly
    assert covered[0][0] == 0 and covered[-1][1] == size // 4
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    for t in set(schedule.ops):
        assert sum(c.hi - c.lo for c in schedule.at(t)) * 4 <= 5e9 * profile.seconds[t] + 1


def test_no_schedule_when_the_step_cannot_move_it_or_memory_does_not_allow_it():
    profile = _step()
    assert plan(profile, 50 * MIB // 4, 4, bandwidth=0.3e9) is None  # 120 ms of step moves 36 MB at most
    # Bandwidth to spare, but the backward frees only 500 MiB: 600 MiB of capture would raise the peak.
    assert plan(profile, 600 * MIB // 4, 4, bandwidth=1e12) is None
    # Allowed a higher peak, the same capture fits.
    assert plan(profile, 600 * MIB // 4, 4, bandwidth=1e12, memory_limit=2 * profile.peak_bytes) is not None


def test_device_memory_untouched_when_the_copy_lands_elsewhere():
    """On CUDA the chunks go to pinned host memory: only the bandwidth constrains them."""
    profile = _step()
    schedule = plan(profile, 600 * MIB // 4, 4, bandwidth=1e12, held_on_device=False)
    assert schedule is not None and schedule.peak_bytes == profile.peak_bytes


def test_split_cuts_only_chunks_above_the_limit_into_equal_pieces():
    assert split([Chunk(0, 10), Chunk(10, 12)], 4) == [Chunk(0, 3), Chunk(3, 6), Chunk(6, 10), Chunk(10, 12)]


def test_the_solver_takes_under_a_second_at_the_demo_models_size():
    """The demo model (4 layers, ~30 leaf modules) gives ~70 ops; a 5 MiB part at a bandwidth that splits it
    into ~20 chunks (the real demo needs none: its schedule is one chunk, see the benchmark)."""
    ops = 72
    profile = OpProfile(tuple(f"op {t}" for t in range(ops)), tuple(0.005 for _ in range(ops)),
                        tuple((min(t, ops - t) + 1) * 4 * MIB for t in range(ops)))
    start = time.perf_counter()
    schedule = plan(profile, 5 * MIB // 12, 12, bandwidth=0.05e9)  # 0.25 MB per op: the part needs 21 ops
    assert time.perf_counter() - start < 1.0
    assert schedule is not None and len(schedule.chunks) >= 20


def test_a_profile_needs_matching_lengths():
    with pytest.raises(ValueError, match="one name, duration"):
        OpProfile(("a", "b"), (0.1,), (1, 2))
