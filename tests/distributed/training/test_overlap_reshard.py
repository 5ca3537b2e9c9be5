"""Resharding between the overlapped and the plain layouts keeps the canonical digest, both ways.

The bucketed communication (``parallel.overlap_*``) leaves every rank the same shard as the plain path, so a
job may change it at any relaunch, along with dp: an overlapped run at dp = 2 checkpoints step 8; the plain
relaunch at dp = 4 restores it resharded (its canonical digest right after restore equals the old run's at
8) and trains to 12; an overlapped relaunch at dp = 2 restores that, again with the same digest.
"""
from __future__ import annotations

import os

import pytest

from megatier.training.trainer import Trainer
from tests.distributed.configs import tiny_job
from tests.distributed.world import run_world

pytestmark = pytest.mark.timeout(400)
JOB = "overlapreshard"
OVERLAPPED = {"overlap_grad_reduce": True, "overlap_param_gather": True, "bucket_mb": 0.02}


def _run(rank: int, tmp: str, prefix: str, run: str, iters: int, parallel: dict) -> dict:
    os.environ.update(MEGATIER_NODE_NAME="node0")
    cfg = tiny_job(tmp, JOB, prefix, iters=iters, run=run, checkpoint={"final_base": False})
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    trainer = Trainer(cfg)
    out = {}
    if run != "first":  # a relaunch: its state right after the restore (train() then goes on from there)
        trainer.restore()
        out = {"step": trainer.step, "restored": trainer.canonical_digest()}
    trainer.train()
    out["final"] = trainer.close()["canonical_digest"]
    return out


def test_overlapped_and_plain_layouts_reshard_into_each_other(corpus_prefix, tmp_path):
    tmp = str(tmp_path)
    first = run_world(_run, 2, tmp_path, tmp, corpus_prefix, "first", 8, OVERLAPPED, timeout_s=180)[0]
    plain = run_world(_run, 4, tmp_path, tmp, corpus_prefix, "plain", 12, {}, timeout_s=180)[0]
    assert plain["step"] == 8 and plain["restored"] == first["final"]
    again = run_world(_run, 2, tmp_path, tmp, corpus_prefix, "again", 14, OVERLAPPED, timeout_s=180)[0]
    assert again["step"] == 12 and again["restored"] == plain["final"]
