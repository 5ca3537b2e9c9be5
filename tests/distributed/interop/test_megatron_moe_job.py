"""A Mixtral-shaped MoE job moved through Megatron-core's torch_dist into another layout: trained by MegaTier on
one rank, exported at step 3 from its tiers (megatier-convert export --format torch_dist: router and experts
under Megatron-core's MoE keys, by global expert index), continued at dp=2 (model.init_from=torch_dist:<dir>),
whose step 4 is the first job's step 4."""
from __future__ import annotations

import os

import pytest

from megatier.cli import convert
from megatier.config import ModelConfig
from megatier.config.schema import MoEConfig
from megatier.interop.torchtitan_dcp import read_dcp
from tests.distributed.interop.continued_job import train_job
from tests.distributed.world import run_world


def _model(init_from) -> ModelConfig:
    return ModelConfig(name="moe2", arch="llama", num_layers=2, hidden_size=32, num_heads=4, num_query_groups=2,
                       max_position_embeddings=32, init_from=init_from,
                       moe=MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=32))


def _run(rank: int, tmp: str, prefix: str, job: str, init_from) -> dict:
    return train_job(tmp, prefix, job, 1, _model(init_from))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_moe_job_continues_through_torch_dist_at_another_layout(corpus_prefix, tmp_path, capsys):
    first = run_world(_run, 1, tmp_path, str(tmp_path), corpus_prefix, "moesrc", None, timeout_s=120)[0]
    save = str(tmp_path / "megatron")
    code = convert.main(["export", "--format", "torch_dist", "--job-id", "moesrc", "--step", "3", "--local-root",
                         str(tmp_path / "shm"), "--remote-url", str(tmp_path / "remote"), save])
    assert code == 0, capsys.readouterr().err
    flat = read_dcp(os.path.join(save, "iter_0000003"))
    assert flat["decoder.layers.mlp.experts.experts.linear_fc1.weight"].shape == (2, 4, 64, 32)
    assert flat["optimizer.state.exp_avg.decoder.layers.mlp.router.weight"].abs().sum() > 0
    moved = run_world(_run, 2, tmp_path, str(tmp_path), corpus_prefix, "moedst", f"torch_dist:{save}",
                      timeout_s=120)
    assert moved[0]["loss"] == pytest.approx(first["loss"], rel=0, abs=1e-5)
