"""A GPT-2 job moved through Megatron-LM's legacy torch format into another layout: trained by MegaTier at tp=1,
exported at step 3 from its tiers at tp=2 x pp=2 with the first stage's optimizer state in several buckets
(megatier-convert export --format megatron_legacy --tp 2 --pp 2 --bucket-size N: mp_rank_00_000 ... mp_rank_01_001
with distrib_optim.pt), continued by a new job at tp=1 dp=2 (model.init_from=megatron_legacy:<save
dir>), whose step 4 takes the first job's samples and loss and ends at the first job's step-4 state (weights,
Adam's moments and count, within fp32 reduction order: dp=2 sums the gradient in another order)."""
from __future__ import annotations

import os

import pytest
import torch

from megatier.cli import convert
from tests.distributed.interop.continued_job import train_job
from tests.distributed.world import run_world


def _run(rank: int, tmp: str, prefix: str, job: str, init_from) -> dict:
    return train_job(tmp, prefix, job, 1, {"num_layers": 2, "init_from": init_from})


def _export(tmp_path, job: str, step: int, out: str, *extra: str) -> str:
    args = ["export", "--format", "megatron_legacy", "--job-id", job, "--step", str(step), "--local-root",
            str(tmp_path / "shm"), "--remote-url", str(tmp_path / "remote"), *extra, out]
    assert convert.main(args) == 0
    return os.path.join(out, f"iter_{step:07d}")


def _state(where: str) -> tuple[int, dict]:
    """Adam's step and the (tp=1) distrib_optim.pt's flat param, exp_avg and exp_avg_sq at ``where``."""
    ckpt = torch.load(os.path.join(where, "mp_rank_00", "model_optim_rng.pt"), weights_only=False)
    (flat,) = torch.load(os.path.join(where, "mp_rank_00", "distrib_optim.pt"), weights_only=False)[0].values()
    return ckpt["optimizer"]["optimizer"]["param_groups"][0]["step"], flat


def _rows(batches: list) -> list[tuple]:
    """A step's samples (tokens and labels) as sorted rows: the same samples whatever the data-parallel split."""
    return sorted(tuple(x.tolist()) + tuple(y.tolist()) for xs, ys in batches for x, y in zip(xs, ys))


@pytest.mark.timeout(240)
def test_a_job_continues_through_megatron_legacy_at_another_layout(corpus_prefix, tmp_path):
    first = run_world(_run, 1, tmp_path, str(tmp_path), corpus_prefix, "mlsrc", None, timeout_s=120)[0]
    save = _export(tmp_path, "mlsrc", 3, str(tmp_path / "legacy"), "--tp", "2", "--pp", "2", "--bucket-size", "3000")
    assert sorted(os.listdir(save)) == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    args = torch.load(os.path.join(save, "mp_rank_00_000", "model_optim_rng.pt"), weights_only=False)["args"]
    assert (args.pipeline_model_parallel_size, args.ddp_bucket_size, args.overlap_grad_reduce) == (2, 3000, True)
    init_from = f"megatron_legacy:{os.path.dirname(save)}"
    moved = run_world(_run, 2, tmp_path, str(tmp_path), corpus_prefix, "mldst", init_from, timeout_s=120)
    assert _rows(first["batch"]) == _rows([b for r in moved for b in r["batch"]])  # step 4's samples, split by dp
    for rank in moved:
        assert rank["loss"] == pytest.approx(first["loss"], rel=0, abs=1e-5)
    assert not torch.equal(first["batch"][0][0], moved[1]["batch"][0][0])  # dp=2: rank 1 has its own samples
    (step, theirs), (moved_step, ours) = (_state(_export(tmp_path, j, 4, str(tmp_path / j)))
                                          for j in ("mlsrc", "mldst"))
    assert step == moved_step == 4  # Adam's count carried over: the moved job's first step was its fourth
    for key in ("param", "exp_avg", "exp_avg_sq"):
        assert torch.allclose(ours[key], theirs[key], rtol=1e-5, atol=1e-9), key
