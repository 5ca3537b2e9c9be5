"""Spread base capture: k parts over k steps, reconciled by replay, is bitwise the snapshot at the base step."""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from megatier.checkpoint.format.payload import decode_base
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.manager import CheckpointManager
from megatier.checkpoint.save import base_capture
from megatier.checkpoint.save.capture import SpreadCapture, clip_ranges, part_bounds
from megatier.checkpoint.tiers.base import JOB as JOB_SCOPE
from megatier.checkpoint.tiers.base import TIER1, TIER3
from megatier.checkpoint.tiers.local import LocalTier
from megatier.checkpoint.tiers.node_memory import NodeMemory
from tests.unit.checkpoint.memory import JOB, MemoryTier, context, snapshot, step, tiny_shard

pytestmark = pytest.mark.timeout(60)
STATE = ("master", "exp_avg", "exp_avg_sq")


def test_parts_tile_the_shard_and_decay_ranges_are_cut_to_them():
    assert part_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert part_bounds(2, 3) == [(0, 0), (0, 1), (1, 2)]
    ranges = torch.tensor([[0, 4], [6, 9]])
    assert clip_ranges(ranges, 3, 7).tolist() == [[0, 1], [3, 4]]
    assert clip_ranges(ranges, 4, 6).tolist() == []


@pytest.mark.parametrize("k", [1, 2, 3, 5, 7])
def test_spread_capture_is_bitwise_the_snapshot(k):
    opt, shard = tiny_shard()
    version = 12
    capture = SpreadCapture(shard, version, k)
    base = None
    for s in range(1, version + 1):
        step(opt, s)
        if s >= version - k + 1:
            pending = capture.after_step(s)
            assert (pending is None) == (s < version)
            base = pending.result() if pending is not None else None
            if s < version:
                assert capture.held_bytes > 0
    want = snapshot(opt)
    for kind in STATE:
        assert torch.equal(getattr(base, kind), want[kind]), kind
    assert base.version == version and base.adam_steps == want["adam_steps"]


def test_a_skipped_step_inside_the_window_replays_as_skipped():
    opt, shard = tiny_shard()
    capture = SpreadCapture(shard, 6, 3)
    for s in range(1, 7):
        if s == 5:  # an fp16 overflow: nothing applied, the flag alone
            opt.last_skipped = True
        else:
            step(opt, s)
            opt.last_skipped = False
        pending = capture.after_step(s) if s >= 4 else None
    base = pending.result()
    want = snapshot(opt)
    assert all(torch.equal(getattr(base, kind), want[kind]) for kind in STATE)


def test_steps_must_come_in_order():
    opt, shard = tiny_shard()
    capture = SpreadCapture(shard, 6, 3)
    step(opt, 1)
    with pytest.raises(ValueError, match="got step 5"):
        capture.after_step(5)


def _bases(capture: str, crash_at: int = 0, *, scheduled: bool = False, interval: int = 10
           ) -> tuple[list[MemoryTier], dict]:
    """Run 20 steps (bases every ``interval``, batches of 5) with ``checkpoint.base_capture`` (k = 4); the tiers and the
    snapshots. ``scheduled``: each step runs a small model's forward and backward first, whose operations the
    capture schedule (profiled at step 2) copies the parts during; ``crash_at``: the process dies after that
    step's after_step."""
    tiers = [MemoryTier(TIER1, takes_steps=True), MemoryTier(TIER3, scope=JOB_SCOPE)]
    ctx = context(tiers, base_interval=interval, batch=5)
    ctx.cfg.base_capture, ctx.cfg.capture_steps = capture, 4
    opt, shard = tiny_shard()
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)) if scheduled else None
    manager = CheckpointManager(ctx, shard, model=model, inline=True)
    manager.restore()
    snaps, metrics = {}, {}
    for s in range(1, (crash_at or 20) + 1):
        if model is not None:
            model(torch.randn(16, 32)).sum().backward()
        step(opt, s)
        snaps[s] = snapshot(opt)
        metrics[s] = manager.after_step(s)
    if not crash_at:
        manager.close()
    return tiers, {"snaps": snaps, "metrics": metrics}


def _base(tiers: list[MemoryTier], version: int):
    payload = next(p for tier in tiers for (_, pid), p in tier.units.items() if pid == PayloadId.base(version))
    return decode_base(payload, job_id=JOB, layout=payload.stamp.layout, source="test")


@pytest.mark.parametrize("scheduled", [False, True], ids=["at-step-end", "scheduled"])
def test_the_manager_publishes_spread_bases_bitwise_equal_to_snapshots(scheduled):
    spread, run = _bases("spread", scheduled=scheduled)
    whole, _ = _bases("snapshot")
    for version in (10, 20):
        a, b = _base(spread, version), _base(whole, version)
        for kind in STATE:
            assert torch.equal(getattr(a, kind), getattr(b, kind)), (version, kind)
        assert torch.equal(a.master, run["snaps"][version]["master"])
    held = [run["metrics"][s]["ckpt_capture_bytes"] for s in range(1, 21)]
    if not scheduled:  # parts copied at the end of steps 7-10; 10 publishes
        assert held[6:9] == sorted(held[6:9]) and held[6] > 0 and held[9] == 0
        assert run["metrics"][10]["base_capture"] == "spread"
    else:  # parts copied during steps 8-11 (a part's buffer exists from the step that copies it); 11 publishes
        assert held[6] == 0 and held[7:10] == sorted(held[7:10]) and held[7] > 0 and held[10] == 0
        assert run["metrics"][11]["base_capture"] == "scheduled" and run["metrics"][11]["base_capture_version"] == 10
        # profiled at step 2, solved on the copier's thread: reported once, by step 7 (the first capture waits)
        lines = {s: m["base_capture_schedule"] for s, m in run["metrics"].items() if "base_capture_schedule" in m}
        assert len(lines) == 1 and 2 <= min(lines) <= 7 and "capture schedule: 1 chunks" in lines[min(lines)]


def test_a_capture_starting_as_the_schedule_is_planned_waits_for_it():
    # Bases every 5 with k = 4: base 5's first part is due at step 2, the step whose after_step gives the
    # copier the planning (the copier starts nothing until the save path is done: it must be let go first).
    spread, run = _bases("spread", scheduled=True, interval=5)
    whole, _ = _bases("snapshot", interval=5)
    for version in (5, 10, 15, 20):
        a, b = _base(spread, version), _base(whole, version)
        assert all(torch.equal(getattr(a, kind), getattr(b, kind)) for kind in STATE), version
    assert "base_capture_schedule" in run["metrics"][2]


@pytest.mark.parametrize("scheduled", [False, True], ids=["at-step-end", "scheduled"])
@pytest.mark.parametrize("crash_at", [17, 18, 19, 20, 21])
def test_a_failure_inside_the_window_keeps_the_previous_base_and_loses_nothing(crash_at, scheduled):
    """Base 20's parts are copied at the end of steps 17-20 (scheduled: during steps 18-21); a crash after any
    of them leaves base 10 the newest until the base is whole, and recovery still reaches the crash step."""
    tiers, run = _bases("spread", crash_at=crash_at, scheduled=scheduled)
    versions = {pid.version for _, pid in tiers[0].units if pid.kind == "base"}
    complete = crash_at >= (21 if scheduled else 20)
    assert max(versions) == (20 if complete else 10), versions
    opt, shard = tiny_shard()
    start, _ = CheckpointManager(context(tiers, base_interval=10, batch=5), shard, inline=True).restore()
    assert start == crash_at
    want = run["snaps"][crash_at]
    assert all(torch.equal(getattr(opt, kind), want[kind]) for kind in STATE) and opt.adam_steps == want["adam_steps"]


def test_staged_parts_leave_the_process_and_come_back_bitwise(tmp_path):
    """With node memory, finished parts wait in its capture folder: the process holds one part and the
    gradient slices at most, and the reconciled bases are still the snapshots."""
    memory = NodeMemory(str(tmp_path), JOB, "node0")
    tiers = [LocalTier(memory, 0, keep_bases=2), MemoryTier(TIER3, scope=JOB_SCOPE)]
    ctx = context(tiers, base_interval=10, batch=5)
    ctx.cfg.base_capture, ctx.cfg.capture_steps = "spread", 4
    opt, shard = tiny_shard()
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    manager = CheckpointManager(ctx, shard, model=model, inline=True)
    manager.restore()
    folder = os.path.join(str(tmp_path), JOB, "node0", "capture", "rank00000")
    snaps, held, staged = {}, {}, {}
    for s in range(1, 21):
        model(torch.randn(16, 32)).sum().backward()
        step(opt, s)
        snaps[s] = snapshot(opt)
        held[s] = manager.after_step(s)["ckpt_capture_bytes"]
        manager.capture._copier.wait()  # the staging writes of this step are done
        staged[s] = sorted(os.listdir(folder))
    manager.close()
    part = opt.master.numel() // 4 * 12
    grads = 6 * opt.master.numel() // 4 * 4  # 3 + 2 + 1 slices of a quarter, fp32
    assert max(held.values()) <= part + 12 * 2 + grads  # part sizes differ by an element at most
    # Base 10: parts copied during steps 8-11; parts 0-2 staged as they finish, the last one reconciled at once.
    assert staged[7] == [] and staged[8] == ["v00000010-part0"]
    assert staged[10] == [f"v00000010-part{j}" for j in range(3)] and staged[11] == []
    assert staged[20] == [f"v00000020-part{j}" for j in range(3)]  # base 20: its last part copied at close
    for version in (10, 20):
        base = decode_base(memory.load(0, PayloadId.base(version)), job_id=JOB, layout=ctx.layout, source="t1")
        for kind in STATE:
            assert torch.equal(getattr(base, kind), snaps[version][kind]), (version, kind)
    assert os.listdir(folder) == []


def test_a_staged_part_is_written_over_the_file_of_a_part_read_back(tmp_path):
    from megatier.checkpoint.save.capture import _Part

    memory = NodeMemory(str(tmp_path), JOB, "node0")
    area = memory.capture_area(0)

    def staged(fill: float, n: int, name: str) -> _Part:
        part = _Part(0, n, {kind: torch.full((n,), fill + i) for i, kind in enumerate(STATE)})
        part.stage(os.path.join(area.directory, name), area.spares)
        return part

    def read_back(part: _Part, n: int) -> dict:
        out = {kind: torch.zeros(n) for kind in STATE}
        part.load_into(out)
        return out

    first = staged(1.0, 1000, "v1-part0")
    inode = os.stat(first.staged).st_ino
    assert read_back(first, 1000)["exp_avg"].eq(2.0).all() and len(area.spares) == 1
    second = staged(5.0, 999, "v2-part0")  # the next capture's part: over the first one's pages, cut to size
    assert os.stat(second.staged).st_ino == inode and os.path.getsize(second.staged) == 999 * 12
    assert len(area.spares) == 0
    out = read_back(second, 999)
    assert all(out[kind].eq(5.0 + i).all() for i, kind in enumerate(STATE))
    memory.release_spares(for_good=True)  # closing: a part read back afterwards is deleted
    third = staged(7.0, 1000, "v3-part0")
    read_back(third, 1000)
    assert not os.path.exists(third.staged) and len(area.spares) == 0
    assert memory.capture_area(0).directory == area.directory and os.listdir(area.directory) == []


def test_a_rank_without_a_schedule_hands_on_its_bases_when_scheduled_ranks_do(monkeypatch):
    # Whether the solver finds a schedule depends on each rank's own timings: one rank may find none where the
    # others do. Its bases must reach the lockstep tiers (Tier-2's ring) at the same step as theirs, one after
    # the version, or the ring's transfers stop pairing up and replication stops.
    _, scheduled = _bases("spread", scheduled=True)
    monkeypatch.setattr(base_capture, "plan", lambda *args, **kwargs: None)
    fallback_tiers, fallback = _bases("spread", scheduled=True)
    whole, _ = _bases("snapshot")
    for run, how in ((scheduled, "scheduled"), (fallback, "spread")):
        handed = {s: (m["base_capture_version"], m["base_capture"]) for s, m in run["metrics"].items()
                  if "base_capture_version" in m}
        assert handed == {11: (10, how)}, handed  # base 20: at close, its step 21 never ran
    assert "none fits" in next(m["base_capture_schedule"] for m in fallback["metrics"].values()
                               if "base_capture_schedule" in m)
    for version in (10, 20):
        a, b = _base(fallback_tiers, version), _base(whole, version)
        assert all(torch.equal(getattr(a, kind), getattr(b, kind)) for kind in STATE), version
