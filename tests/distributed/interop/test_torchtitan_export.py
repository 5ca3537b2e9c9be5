"""A Llama job trained by MegaTier (tp=1; the import test runs tp=2), exported from its tiers with
megatier-convert export --format torchtitan, continues in torchtitan with the loss MegaTier's own relaunch takes
at the next step."""
from __future__ import annotations

import os

import pytest

from megatier.cli import convert
from megatier.config import ModelConfig, OptimConfig
from megatier.training.trainer import Trainer
from tests.distributed.configs import tiny_job
from tests.distributed.interop.titan_continue import load_in_torchtitan, step_in_torchtitan
from tests.distributed.world import run_world
from tests.torchtitan_llama import import_torchtitan

import_torchtitan()

JOB, VOCAB = "ttexport", 257
FIELDS = dict(name="tt2", arch="llama", num_layers=2, hidden_size=32, num_heads=4, num_query_groups=2,
              max_position_embeddings=32, make_vocab_size_divisible_by=128)
OPTIM = dict(lr=1e-3, warmup_iters=0, decay_style="constant", weight_decay=0.1, clip_grad=0.0)


def _run(rank: int, tmp: str, prefix: str, iters: int) -> dict:
    os.environ.update(MEGATIER_NODE_NAME="node0")
    cfg = tiny_job(tmp, JOB, prefix, iters=iters, tp=1, model=ModelConfig(**FIELDS), optim=OPTIM,
                   checkpoint={"final_base": False}, train={"global_batch_size": 4})
    trainer = Trainer(cfg)
    trainer.train()
    out = {"loss": trainer.last_record["loss"], "batches": trainer.batches.train_microbatches(iters)}
    trainer.close()
    return out


@pytest.mark.timeout(240)
def test_a_megatier_job_continues_in_torchtitan_with_the_same_loss(corpus_prefix, tmp_path, capsys):
    run_world(_run, 1, tmp_path, str(tmp_path), corpus_prefix, 3, timeout_s=120)
    code = convert.main(["export", "--format", "torchtitan", "--job-id", JOB, "--local-root", str(tmp_path / "shm"),
                         "--remote-url", str(tmp_path / "remote"), str(tmp_path / "titan")])
    assert code == 0, capsys.readouterr().err
    assert os.listdir(tmp_path / "titan") == ["step-3"]
    ours = run_world(_run, 1, tmp_path, str(tmp_path), corpus_prefix, 4, timeout_s=120)[0]  # restores at 3

    job = load_in_torchtitan(str(tmp_path / "titan"), 3, ModelConfig(**FIELDS), OptimConfig(**OPTIM), VOCAB, tmp_path,
                             seed=3)
    assert job.train_state.ntokens_seen == 3 * 4 * 32
    assert step_in_torchtitan(job, ours["batches"]) == pytest.approx(ours["loss"], rel=0, abs=1e-5)
