"""A GPT-2 job moved through Megatron-core's torch_dist format into another layout: trained by MegaTier at tp=1,
exported at step 3 from its tiers (megatier-convert export --format torch_dist), continued by a new job at tp=2
(model.init_from=torch_dist:<save dir>), whose step 4 is the first job's step 4."""
from __future__ import annotations

import os

import pytest

from megatier.cli import convert
from megatier.training.trainer import Trainer
from tests.distributed.configs import tiny_job
from tests.distributed.interop.continued_job import OPTIM, train_job
from tests.distributed.world import run_world

pytest.importorskip("megatron.core")


def _run(rank: int, tmp: str, prefix: str, job: str, tp: int, init_from) -> dict:
    return train_job(tmp, prefix, job, tp, {"num_layers": 2, "init_from": init_from})


@pytest.mark.timeout(240)
def test_a_job_continues_through_torch_dist_at_another_layout(corpus_prefix, tmp_path, capsys):
    first = run_world(_run, 1, tmp_path, str(tmp_path), corpus_prefix, "mcsrc", 1, None, timeout_s=120)[0]
    save = str(tmp_path / "megatron")
    code = convert.main(["export", "--format", "torch_dist", "--job-id", "mcsrc", "--step", "3", "--local-root",
                         str(tmp_path / "shm"), "--remote-url", str(tmp_path / "remote"), save])
    assert code == 0, capsys.readouterr().err
    assert sorted(os.listdir(save)) == ["iter_0000003", "latest_checkpointed_iteration.txt"]
    moved = run_world(_run, 2, tmp_path, str(tmp_path), corpus_prefix, "mcdst", 2, f"torch_dist:{save}",
                      timeout_s=120)
    for a, b in zip(first["batch"], moved[0]["batch"]):
        assert all((x == y).all() for x, y in zip(a, b))  # the same samples at step 4
    assert moved[0]["loss"] == pytest.approx(first["loss"], rel=0, abs=1e-5)
    again = run_world(_relaunch, 1, tmp_path, str(tmp_path), corpus_prefix, f"torch_dist:{save}", timeout_s=120)
    assert again == [(4, True)]  # its own checkpoint at 4 (resharded to tp=1), not the import at 3


def _relaunch(rank: int, tmp: str, prefix: str, init_from: str) -> tuple[int, bool]:
    """The moved job launched again: it restores its own state, never the import."""
    os.environ.update(MEGATIER_NODE_NAME="node0")
    cfg = tiny_job(tmp, "mcdst", prefix, iters=4, tp=1, model={"num_layers": 2, "init_from": init_from},
                   optim=OPTIM, run="run-mcdst", checkpoint={"final_base": False, "diff": {"batch": 1}},
                   train={"global_batch_size": 4})
    trainer = Trainer(cfg)
    trainer.train()
    out = (trainer.step, trainer.already_finished)
    trainer.close()
    return out
