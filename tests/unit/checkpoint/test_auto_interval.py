"""base_interval=auto in the manager: no base during the warm-up, one decision, bases at its interval after."""
from __future__ import annotations

import pytest

from megatier.checkpoint.manager import CheckpointManager
from megatier.checkpoint.policy.auto_interval import decide, provisional_interval, replay_seconds_per_step
from megatier.checkpoint.tiers.base import JOB as JOB_SCOPE
from megatier.checkpoint.tiers.base import TIER1, TIER3
from megatier.config import CheckpointConfig
from tests.unit.checkpoint.memory import MemoryTier, context, step, tiny_shard

pytestmark = pytest.mark.timeout(60)


def _auto(cfg: CheckpointConfig, **kw) -> CheckpointConfig:
    cfg.base_interval, cfg.mtbf_hours, cfg.auto_warmup_steps = "auto", 1.0, 10
    for key, value in kw.items():
        setattr(cfg, key, value)
    return cfg


def test_the_manager_decides_once_after_the_warmup_and_bases_follow_the_choice():
    tiers = [MemoryTier(TIER1, takes_steps=True), MemoryTier(TIER3, scope=JOB_SCOPE)]
    ctx = context(tiers, batch=5)
    _auto(ctx.cfg, auto_max_interval=30)
    opt, shard = tiny_shard(iters=80)
    manager = CheckpointManager(ctx, shard, inline=True)
    manager.restore()
    records = {}
    for s in range(1, 71):
        step(opt, s)
        records[s] = manager.after_step(s)
    manager.close()
    chosen = [r["base_interval"] for r in records.values() if "base_interval" in r]
    assert len(chosen) == 1 and "base_interval" in records[10]  # decided at the end of the warm-up
    n = chosen[0]
    assert 15 <= n <= 30 and n % 5 == 0 and 0 < records[10]["base_interval_goodput"] <= 1
    versions = sorted({pid.version for _, pid in tiers[0].units if pid.kind == "base"} |
                      {pid.version for _, pid in tiers[1].units if pid.kind == "base"})
    interval_bases = set(versions) - {70}  # 70: the final base at close
    assert interval_bases <= set(range(0, 71, n)) and max(interval_bases) == 70 // n * n, (n, versions)


def test_every_rank_takes_the_worst_figures_and_the_node_count_scales_the_node_mtbf():
    cfg = _auto(CheckpointConfig(), node_mtbf_hours=10.0, mtbf_hours=None)
    rows = [{"step_s": 1.0, "base_s": 2.0, "replay_s": 0.01, "upload_s": 0.0, "node": "a"},
            {"step_s": 1.2, "base_s": 8.0, "replay_s": 0.02, "upload_s": 30.0, "node": "b"}]
    choice, costs, mtbf = decide(cfg, rows)
    assert (costs.step_s, costs.base_s, costs.replay_s, costs.upload_s) == (1.2, 8.0, 0.02, 30.0)
    assert mtbf == 5.0  # two nodes of 10 hours each
    assert choice.interval % cfg.diff.batch == 0 and choice.interval >= provisional_interval(cfg)


def test_the_replay_time_is_measured_and_scales_with_the_shard():
    opt, _ = tiny_shard()
    assert replay_seconds_per_step(opt.master, opt.cfg, opt.decay_ranges) > 0
