"""A job on a blend of Megatron-format corpora loses a node mid-run (one torchrun agent per node, as
megatier-run launches) and its relaunch ends bit-identical to the fault-free run: the loader's position is part
of the state, and the blend's order is rebuilt the same on every launch."""
from __future__ import annotations

import pytest

from tests.distributed.cli.test_drill import drill

pytestmark = pytest.mark.timeout(600)


def test_a_node_lost_on_a_blend_job_recovers_bit_identically(tmp_path, blend):
    overrides = ["model=tiny", "parallel.tp=2", "train.iters=30", "train.micro_batch_size=2",
                 "train.global_batch_size=4", "data.seq_len=64", "checkpoint.base_interval=20",
                 "checkpoint.diff.compression=fp32", "logging.wandb.mode=disabled", "parallel.timeout_s=30", *blend]
    report = drill(tmp_path, "--nodes", "2", "--procs-per-node", "2", "--fail", "node", "--at-step", "17",
                   "--compare", overrides=overrides)
    assert report["ok"], report["stdout"][-3000:]
    (rec,) = report["recoveries"]
    assert rec["failure_class"] == "node" and 17 - rec["end"] <= 2, rec
    assert report["final_digest"] == report["reference_digest"]
