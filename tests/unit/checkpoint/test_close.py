"""close() is bounded when Tier-3 is down at exit and says what stayed behind; a healthy run says it is durable;
the last hand-over gives a lockstep tier one base."""
from __future__ import annotations

import time

import pytest

from megatier.checkpoint.checkpointer import build_checkpointer
from megatier.checkpoint.context import build_context
from megatier.checkpoint.manager import CheckpointManager
from megatier.checkpoint.shard import ShardAccess
from megatier.checkpoint.tiers.base import TIER2
from megatier.checkpoint.tiers.remote import open_remote_store
from megatier.cli import convert
from megatier.training.trainer import Trainer
from tests.checkpoint_fakes import DownAfter
from tests.unit.checkpoint.memory import MemoryTier

pytestmark = pytest.mark.timeout(120)


def _config(tiny_config, tmp_path, *extra):
    return tiny_config("checkpoint=tiered", "checkpoint.tiers=[local,remote]", f"checkpoint.local.root={tmp_path}/shm",
                       f"checkpoint.remote.url={tmp_path}/t3", "checkpoint.base_interval=10", "train.iters=12",
                       "checkpoint.remote.drain_timeout_s=2", *extra)


def test_a_tier3_outage_at_exit_ends_in_bounded_time_with_a_clear_status(tiny_config, tmp_path, caplog):
    cfg = _config(tiny_config, tmp_path)
    store = DownAfter(open_remote_store(f"{tmp_path}/t3", cfg.checkpoint.job_id, fsync=False), ok_writes=8)
    trainer = Trainer(cfg, checkpointer=lambda state: build_checkpointer(
        cfg.checkpoint, state, timeout_s=cfg.parallel.timeout_s, remote_store=store))
    trainer.train()
    t0 = time.monotonic()
    summary = trainer.close()
    assert time.monotonic() - t0 < 20.0
    assert summary["checkpoint_behind"] and summary["checkpoint_units_behind"] > 0
    assert summary["checkpoint_saved_step"] == 12 and (summary["checkpoint_durable_step"] or 0) < 12
    assert summary["state_digest"] and summary["step"] == 12  # the run itself finished
    assert "units behind at exit" in caplog.text and "remain only in Tier-1" in caplog.text


def test_a_healthy_run_ends_durable_at_its_last_step_and_exports_it_exactly(tiny_config, tmp_path, capsys):
    cfg = _config(tiny_config, tmp_path)  # 12 steps, diff batches of 5, a base every 10, lossy (adaptive) diffs
    trainer = Trainer(cfg)
    trainer.train()
    summary = trainer.close()
    assert summary["checkpoint_behind"] is False
    assert summary["checkpoint_durable_step"] == summary["checkpoint_saved_step"] == 12  # the open batch closed
    capsys.readouterr()
    status = convert.main(["export", "--job-id", cfg.checkpoint.job_id, "--tier", "tier3", "--remote-url",
                           f"{tmp_path}/t3", str(tmp_path / "hf")])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "step 12 from base v12" in out  # the final base: nothing replayed, so nothing lossy
    assert f"canonical_digest: {summary['canonical_digest']}" in out  # the weights and moments training had


def test_a_run_ending_one_step_after_a_base_hands_the_lockstep_tier_one_base_at_close(tiny_config, tmp_path):
    # The scheduled capture hands base v10 on at step 11, the last step, so the close's hand-over held it when
    # the final base v11 joined it; Tier-2 takes one base per step and refused the pair. v11 supersedes v10
    # there (Tier-1 and Tier-3 still store both).
    cfg = tiny_config("checkpoint=tiered", "checkpoint.tiers=[local,remote]", f"checkpoint.local.root={tmp_path}/shm",
                      f"checkpoint.remote.url={tmp_path}/t3", "checkpoint.base_interval=10", "train.iters=11",
                      "checkpoint.base_capture=spread", "checkpoint.capture_schedule=checkflow")
    peer = MemoryTier(TIER2, lockstep=True)

    def checkpointer(state):  # build_checkpointer's, with a lockstep tier (one node has no Tier-2 peer)
        ctx = build_context(cfg.checkpoint, state.ps, timeout_s=30.0, fingerprint=state.fingerprint)
        ctx.tiers.insert(1, peer)
        return CheckpointManager(ctx, ShardAccess(state.optimizer, state.global_batch_size), model=state.model)

    trainer = Trainer(cfg, checkpointer=checkpointer)
    trainer.train()
    summary = trainer.close()
    bases = [(tick, pid.last) for tick, pid in peer.puts if pid.kind == "base"]
    assert bases[-1] == (11, 11) and len({tick for tick, _ in bases}) == len(bases), bases
    assert summary["checkpoint_durable_step"] == 11
