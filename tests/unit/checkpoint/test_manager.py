"""The checkpoint policy with in-memory tiers: no threads, no process groups (the save worker runs inline)."""
from __future__ import annotations

import pytest
import torch

from megatier.checkpoint.format.finite import NonFiniteState
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.manager import CheckpointManager
from megatier.checkpoint.save import clock as clock_module
from megatier.checkpoint.tiers.base import JOB, TIER1, TIER2, TIER3
from megatier.checkpoint.watermark import recovery_points
from tests.unit.checkpoint.memory import MemoryTier, context, snapshot, step, tiny_shard

pytestmark = pytest.mark.timeout(60)
B, D = PayloadId.base, PayloadId.diff


def _tiers(peer: bool = False) -> list[MemoryTier]:
    tiers = [MemoryTier(TIER1)]
    if peer:
        tiers.append(MemoryTier(TIER2, lockstep=True))
    return tiers + [MemoryTier(TIER3, scope=JOB)]


def _train(tiers, steps: int, *, start_opt=None) -> tuple[CheckpointManager, object, dict, list[dict]]:
    opt, shard = start_opt or tiny_shard()
    manager = CheckpointManager(context(tiers), shard, inline=True)
    first, record = manager.restore()
    snaps, metrics = {first: snapshot(opt)}, []
    for s in range(first + 1, first + steps + 1):
        step(opt, s)
        snaps[s] = snapshot(opt)
        metrics.append(manager.after_step(s))
    return manager, opt, snaps, metrics


def test_fresh_start_saves_the_streams_and_reclaims_behind_the_watermark():
    tiers = _tiers()
    manager, _, _, metrics = _train(tiers, 12)
    t1, t3 = tiers
    assert manager.anchor == 0 and all(t.started for t in tiers)
    assert [pid for _, pid in t3.puts] == [B(0), D(1, 5), D(6, 10), B(10)]
    # Each sync moves the watermark to the newest durable base; Tier-1 drops what it made obsolete.
    assert t1.watermarks == t3.watermarks == [0, 10] and metrics[4]["watermark"] == 0
    assert metrics[9]["watermark"] == 10
    assert t1.held() == [B(10)]
    assert metrics[9]["rpo_software"] == metrics[9]["rpo_rack"] == 10 and metrics[9]["rpo_node"] == 10
    assert metrics[4]["rpo_software"] == 5 and metrics[4]["diff_bytes"] > 0 and metrics[9]["base_bytes"] > 0
    assert t1.ticks == list(range(1, 13))


def test_the_save_thread_gets_a_step_after_the_tiers_ticks():
    # The helpers are woken last in after_step: the inline save thread stores the batch closed at step s (and
    # the base of s) after every tier's tick of s; woken first, it stored them before the tick of s.
    tiers = _tiers()
    _train(tiers, 10)
    t3 = tiers[-1]
    assert t3.puts == [(None, B(0)), (5, D(1, 5)), (10, D(6, 10)), (10, B(10))]


def test_lockstep_tier_gets_each_unit_one_step_after_it_finished_and_the_rest_at_close():
    tiers = _tiers(peer=True)
    manager, *_ = _train(tiers, 11)
    peer = tiers[1]
    # (last tick before the put, unit): the anchor goes over at step 1, the batch closed at 5 at step 6, ...
    assert peer.puts == [(None, B(0)), (5, D(1, 5)), (10, D(6, 10)), (10, B(10))]
    manager.close(timeout=5.0)
    assert all(t.closed for t in tiers)


def test_restart_recovers_bit_exactly_from_tier1_and_rebases():
    tiers = _tiers()
    first, _, snaps, _ = _train(tiers, 12)
    opt, shard = tiny_shard()
    manager = CheckpointManager(context(tiers), shard, inline=True)
    start, record = manager.restore()
    assert (start, record["version"], record["end"]) == (10, 10, 10)
    assert record["failure_class"] == "software" and record["source_tiers"][TIER1] == 1
    for name in ("master", "exp_avg", "exp_avg_sq", "params"):
        assert torch.equal(getattr(opt, name if name != "params" else "param_flat"), snaps[10][name]), name
    assert manager.anchor == 10 and opt.adam_steps == snaps[10]["adam_steps"]


def test_rack_failure_replays_the_tier3_chain_bit_exactly():
    tiers = _tiers()
    _, _, snaps, _ = _train(tiers, 18)
    tiers[0].units.clear()  # the node's memory is gone
    opt, shard = tiny_shard()
    start, record = CheckpointManager(context(tiers), shard, inline=True).restore()
    assert (start, record["version"], record["failure_class"]) == (15, 10, "rack")
    assert torch.equal(opt.master, snaps[15]["master"]) and torch.equal(opt.exp_avg_sq, snaps[15]["exp_avg_sq"])


def test_recovery_points_per_class():
    n = -1
    cols = {TIER1: [12, 10], TIER2: [10, n], TIER3: [5, n]}
    assert recovery_points(cols, 13) == {"rpo_software": 10, "rpo_node": 5, "rpo_rack": 5, "t2_lag_steps": None,
                                         "t3_lag_steps": 8}
    assert recovery_points({TIER1: [12, 10]}, 13)["rpo_node"] is None  # no Tier-2, no Tier-3: nothing survives
    assert recovery_points({TIER3: [n]}, 3) == {"rpo_software": None, "rpo_node": None, "rpo_rack": None,
                                                "t2_lag_steps": None, "t3_lag_steps": None}


def test_the_loops_serial_work_runs_with_its_team_parked_until_the_helpers_are_woken(monkeypatch):
    # Compression and the step unit's write run inside ops.run_with_team_parked (an idle OpenMP thread would
    # spin through them); the ticks and submits wake the helper threads, which then took the parked thread's
    # core, so they come after the region (leaving it had waited up to a scheduler slice for a core).
    depth, calls = [0], []
    real = clock_module.ops.run_with_team_parked

    def tracking(fn):
        depth[0] += 1
        try:
            return real(fn)
        finally:
            depth[0] -= 1

    def recorded(name, fn):
        def wrapper(*args, **kwargs):
            calls.append((name, depth[0] > 0))
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(clock_module.ops, "run_with_team_parked", tracking)
    tiers = [MemoryTier(TIER1, takes_steps=True), MemoryTier(TIER3, scope=JOB)]
    opt, shard = tiny_shard()
    manager = CheckpointManager(context(tiers), shard, inline=True)
    first, _ = manager.restore()
    monkeypatch.setattr(shard, "compress", recorded("compress", shard.compress))
    monkeypatch.setattr(manager, "_save_step_unit", recorded("step_unit", manager._save_step_unit))
    for tier in tiers:
        monkeypatch.setattr(tier, "on_step", recorded("tick", tier.on_step))
    monkeypatch.setattr(manager.worker, "submit_diff", recorded("submit", manager.worker.submit_diff))
    metrics = []
    for s in range(first + 1, first + 7):
        step(opt, s)
        metrics.append(manager.after_step(s))
    manager.close()
    assert {name for name, _ in calls} == {"compress", "step_unit", "tick", "submit"}
    assert all(parked == (name in ("compress", "step_unit")) for name, parked in calls), calls
    assert all(m["ckpt_unpark_ms"] >= 0.0 for m in metrics)


def test_a_base_of_a_state_holding_nan_is_never_stored():
    """The save thread checks a base before handing it on; the loop learns it at the next hand-over."""
    tiers = _tiers()
    opt, shard = tiny_shard()
    manager = CheckpointManager(context(tiers), shard, inline=True)
    manager.restore()
    for s in range(1, 10):
        step(opt, s)
        manager.after_step(s)
    step(opt, 10)
    opt.exp_avg_sq[2] = float("inf")  # a corrupted shard (a bit flip, a bad kernel), not a step's gradient
    with pytest.raises(NonFiniteState, match=r"^rank 0: the training state at step 10 holds NaN or inf in "
                                             r"exp_avg_sq; its base was not stored"):
        manager.after_step(10)
    assert all(pid != B(10) for t in tiers for _, pid in t.units)
    assert (0, B(0)) in tiers[0].units and (0, D(6, 10)) in tiers[0].units  # what was stored stays


def test_a_restore_reclaims_behind_the_newest_committed_base_before_any_sync():
    """A job whose launches all end before a watermark sync completes must still reclaim: the restore hands the
    newest base committed on Tier-3 (at or before the point restored) on as the watermark."""
    tiers = [MemoryTier(TIER1, takes_steps=True), MemoryTier(TIER3, scope=JOB)]
    opt, shard = tiny_shard()
    manager = CheckpointManager(context(tiers, base_interval=10, batch=5), shard, inline=True)
    manager.restore()
    for s in range(1, 26):
        step(opt, s)
        manager.after_step(s)
    tiers[1].watermarks.clear()  # the crash: dropped without close()
    relaunch = CheckpointManager(context(tiers, base_interval=10, batch=5), tiny_shard()[1], inline=True)
    start, _ = relaunch.restore()
    assert start == 25 and relaunch.watermark == 20 and tiers[1].watermarks == [20]
    assert sorted(p.version for p in tiers[0].held() if p.kind == "base") == [20, 25]  # bases 0 and 10 reclaimed
