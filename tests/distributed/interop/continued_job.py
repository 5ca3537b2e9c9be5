"""The job the torch_dist continuation tests train on one node: 4 steps, a diff unit per step, no final base.
Returns its step-4 loss and the micro-batches of step 4, which the job continued from its export must match."""
from __future__ import annotations

import os

from megatier.training.trainer import Trainer
from tests.distributed.configs import tiny_job

OPTIM = dict(lr=1e-3, warmup_iters=0, decay_style="constant", clip_grad=0.0)


def train_job(tmp: str, prefix: str, job: str, tp: int, model) -> dict:
    os.environ.update(MEGATIER_NODE_NAME="node0")
    cfg = tiny_job(tmp, job, prefix, iters=4, tp=tp, model=model, optim=OPTIM, run=f"run-{job}",
                   checkpoint={"final_base": False, "diff": {"batch": 1}}, train={"global_batch_size": 4})
    trainer = Trainer(cfg)
    trainer.train()
    out = {"loss": trainer.last_record["loss"], "batch": trainer.batches.train_microbatches(4)}
    trainer.close()
    return out
