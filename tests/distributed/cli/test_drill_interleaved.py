"""A lossless software-failure drill of an interleaved job (pp=2 x parallel.virtual_stages=2) ends bit-identical
to its fault-free run: checkpointing, restore and the replay of the chain keep the model chunks' state exact."""
from __future__ import annotations

import pytest

from tests.distributed.cli.test_drill import drill, fault_free_digest

# 2 nodes x 1 process, one pipeline stage each, two model chunks of one layer per stage; base 10, the drill's
# lossless diff batches of 5, failure at 17: the restore replays the chain 10 -> 17.
INTERLEAVED = ["model=tiny", "model.num_layers=4", "parallel.pp=2", "parallel.virtual_stages=2", "train.iters=18",
               "checkpoint.base_interval=10", "checkpoint.diff.compression=fp32", "logging.wandb.mode=disabled",
               "data.seq_len=64", "train.global_batch_size=4", "train.micro_batch_size=2",
               "parallel.timeout_s=30"]


@pytest.mark.timeout(480)  # a reference run, the drilled launch and its relaunch: 164 s in CI, 300 on a loaded box
def test_an_interleaved_job_recovers_bit_identical(tmp_path, tmp_path_factory):
    reference = fault_free_digest(tmp_path_factory, "interleaved_ref", INTERLEAVED, procs=1)
    report = drill(tmp_path, "--procs-per-node", "1", "--fail", "software", "--at-step", "17",
                   overrides=INTERLEAVED)
    assert report["ok"], report["stdout"]
    (rec,) = report["recoveries"]
    assert rec["failure_class"] == "software" and rec["version"] == 10 and rec["end"] == 17, rec
    assert rec["rank_tiers"] == [["tier1"], ["tier1"]], rec
    assert report["final_digest"] == reference
