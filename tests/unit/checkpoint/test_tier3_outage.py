"""A Tier-3 outage as a user meets it (S3 behind a proxy that resets every connection): reported within a diff
batch, an exit bounded by remote.drain_timeout_s, a relaunch while it lasts that trains from node memory, and
the catch-up once Tier-3 answers again."""
from __future__ import annotations

import time

import pytest

from megatier.checkpoint.checkpointer import build_checkpointer
from megatier.training.trainer import Trainer
from tools.chaos.s3_proxy import FaultRule, S3FaultProxy

pytestmark = pytest.mark.timeout(240)
DRAIN_S = 4.0


class Weather:
    """The tiered checkpointer, with ``before(step)`` run before each step's save and the step records kept."""

    def __init__(self, manager, before):
        self.manager, self.before, self.records = manager, before, []

    def restore(self):
        return self.manager.restore()

    def after_step(self, step: int) -> dict:
        self.before(step)
        out = self.manager.after_step(step)
        self.records.append({"step": step, **out})
        return out

    def close(self, *, failed: bool = False):
        return self.manager.close(failed=failed)


def _trainer(cfg, before) -> Trainer:
    return Trainer(cfg, checkpointer=lambda state: Weather(build_checkpointer(
        cfg.checkpoint, state, timeout_s=cfg.parallel.timeout_s), before))


def test_a_tier3_outage_is_seen_at_once_bounded_at_exit_and_survived_by_a_relaunch(tiny_config, tmp_path, s3_url,
                                                                                   caplog):
    url, endpoint = s3_url
    proxy = S3FaultProxy(endpoint).start()
    common = ["checkpoint=tiered", "checkpoint.tiers=[local,remote]", f"checkpoint.local.root={tmp_path}/shm",
              f"checkpoint.remote.url={url}", f"checkpoint.remote.endpoint_url={proxy.url}", "checkpoint.job_id=out",
              f"checkpoint.remote.drain_timeout_s={DRAIN_S}", "checkpoint.remote.lease_s=3",
              "checkpoint.base_interval=10", "checkpoint.diff.compression=fp32", "optim.decay_iters=100"]

    def down_from_12(step: int) -> None:
        if step == 12:
            proxy.set_rule(FaultRule("reset"))

    try:
        trainer = _trainer(tiny_config(*common, "train.iters=30"), down_from_12)
        trainer.train()
        t0 = time.monotonic()
        summary = trainer.close()
        exit_s = time.monotonic() - t0
        records = trainer.checkpointer.records
        first = next(r["step"] for r in records if "Tier-3" in (r.get("degraded") or ""))
        assert 12 < first <= 20, first  # the first upload after step 12 fails at batch 15, seen by the sync at 20
        assert all(r.get("degraded") is None for r in records if r["step"] <= 10)
        assert exit_s <= DRAIN_S + 10, exit_s
        assert summary["checkpoint_behind"] and summary["checkpoint_saved_step"] == 30
        assert caplog.text.count("checkpointing is degraded") == 1  # one console line for the outage

        def back_at_33(step: int) -> None:  # steps slow enough for rank 0 to reach Tier-3 again meanwhile
            if step == 33:
                proxy.clear()
            if step >= 33:
                time.sleep(0.15)

        caplog.clear()
        again = _trainer(tiny_config(*common, "train.iters=70", f"logging.run_dir={tmp_path}/run2"), back_at_33)
        again.train()
        summary = again.close()
    finally:
        proxy.stop()
    rec = again.checkpointer.records
    assert "unreachable at start-up" in caplog.text and "answers again" in caplog.text
    synced = [r for r in rec if "degraded" in r]  # degraded is known from the first watermark sync (step 35)
    assert "has not answered since the launch" in synced[0]["degraded"]  # started from node memory
    assert rec[-1]["degraded"] is None
    assert summary["checkpoint_behind"] is False and summary["checkpoint_durable_step"] == 70
