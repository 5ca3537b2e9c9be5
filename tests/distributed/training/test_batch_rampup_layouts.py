"""A batch-size ramp-up trains the same steps under pipeline and data parallelism as in one process: each
dp rank takes its share of every ramp batch, and the pipeline runs as many micro-batches as that share holds."""
from __future__ import annotations

import pytest
import torch

from megatier.training.trainer import Trainer
from tests.distributed.configs import tiny_job
from tests.distributed.world import run_world

STEPS = 6  # batches 4, 4, 6, then 8: ramp [4, 2, 12] of a global batch of 8


def _worker(rank: int, pp: int, prefix: str, run_dir: str) -> dict:
    cfg = tiny_job("", "ramp", prefix, iters=STEPS, pp=pp, run=run_dir,
                   train={"micro_batch_size": 1, "rampup_batch_size": [4, 2, 12]})
    trainer = Trainer(cfg)
    out = {"losses": [], "batches": [len(trainer.batches.train_microbatches(s)) for s in range(1, STEPS + 1)]}
    for step in range(1, STEPS + 1):
        out["losses"].append(trainer.train_step(step)["loss"])
        trainer.step = step
    trainer.close()
    return out


@pytest.mark.timeout(240)
def test_a_ramp_under_pp2_dp2_trains_the_single_process_steps(corpus_prefix, tmp_path):
    (single,) = run_world(_worker, 1, tmp_path, 1, corpus_prefix, str(tmp_path / "one"))
    assert single["batches"] == [4, 4, 6, 8, 8, 8]  # micro-batches of one sample
    results = run_world(_worker, 4, tmp_path, 2, corpus_prefix, str(tmp_path / "four"), timeout_s=120.0)
    for res in results:
        assert res["batches"] == [2, 2, 3, 4, 4, 4]  # each dp rank's half
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor(single["losses"]), rtol=1e-5, atol=0)
