"""One node on CUDA with NCCL: a run with tiered checkpointing, and a lossless software-failure drill whose final
state is bit-identical to the fault-free run's. Skipped without CUDA.

One process per GPU, at most two (dp=2 with two GPUs; one process on a one-GPU machine). CUDA kernels are not
bitwise reproducible by default (the memory-efficient attention backward accumulates with atomics), and the
drill's comparison needs training that is: every process of the drill runs with
``torch.use_deterministic_algorithms(True)`` and ``CUBLAS_WORKSPACE_CONFIG=:4096:8``, set by a ``sitecustomize``
this test puts first on ``PYTHONPATH`` (the trainer has no switch for it).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatier import fastpaths
from megatier.drill.cluster import LocalCluster
from tests.conftest import REPO

CUDA = fastpaths.cuda_missing()
pytestmark = pytest.mark.skipif(CUDA is not None, reason=f"needs a GPU: {CUDA}")
PROCS = min(2, torch.cuda.device_count()) if CUDA is None else 1
TE = f"a GPU: {CUDA}" if CUDA is not None else fastpaths.transformer_engine_missing()
JOB = ["model=tiny", "train.device=cuda", "train.iters=30", "checkpoint=tiered", "checkpoint.base_interval=10",
       "checkpoint.diff.compression=fp32", "logging.wandb.mode=disabled", "logging.progress=false", "data.seq_len=64",
       "train.global_batch_size=4", "train.micro_batch_size=2", "parallel.timeout_s=60"]


def _env(tmp_path: Path) -> dict:
    site = tmp_path / "deterministic"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text("import torch\ntorch.use_deterministic_algorithms(True)\n")
    path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return dict(os.environ, PYTHONPATH=path, CUBLAS_WORKSPACE_CONFIG=":4096:8", WANDB_MODE="disabled",
                OMP_NUM_THREADS="1")


def _fp8_missing():
    return TE if TE is not None else fastpaths.fp8_missing()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("impl,precision", [
    ("native", "fp32"),
    pytest.param("te", "fp32", marks=pytest.mark.skipif(TE is not None, reason=f"needs Transformer Engine and {TE}")),
    pytest.param("te", "fp8", marks=pytest.mark.skipif(_fp8_missing() is not None,
                                                       reason=f"needs fp8 in Transformer Engine: {_fp8_missing()}")),
])
def test_tiered_run_on_nccl(tmp_path, monkeypatch, impl, precision):
    work = tmp_path / "work"
    args = [str(REPO / "pretrain_gpt.py"), *JOB, f"model.impl={impl}", f"train.precision={precision}",
            f"checkpoint.local.root={work}/shm",
            f"checkpoint.remote.url={work}/remote", f"logging.run_dir={work}/run", "checkpoint.job_id=gpu"]
    monkeypatch.setenv("WANDB_MODE", "disabled")
    cluster = LocalCluster(1, PROCS, args)
    cluster.start()
    assert cluster.wait(fail_grace_s=5.0, timeout_s=500) == 0  # 0: trained, and every checkpoint durable
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines() if line]
    steps = [r for r in records if "event" not in r]
    summary = [r for r in records if r.get("event") == "summary"][-1]
    assert [r["step"] for r in steps] == list(range(1, 31))
    assert all(r["diff_bytes"] > 0 for r in steps) and any(r.get("base_bytes", 0) > 0 for r in steps)
    assert summary["checkpoint_durable_step"] == 30, summary
    assert steps[-1]["loss"] < steps[0]["loss"]


@pytest.mark.timeout(900)
def test_lossless_software_drill_on_nccl(tmp_path):
    out = tmp_path / "drill.json"
    cmd = [sys.executable, str(REPO / "scripts" / "failure_drill.py"), "--nodes", "1", "--procs-per-node",
           str(PROCS), "--fail", "software", "--at-step", "17", "--compare", "--work-dir", str(tmp_path / "work"),
           "--json", str(out), "--", *[o for o in JOB if o != "checkpoint=tiered"]]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=840)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["ok"] and proc.returncode == 0, proc.stdout[-3000:]
    (rec,) = report["recoveries"]
    assert rec["failure_class"] == "software" and all(t == ["tier1"] for t in rec["rank_tiers"]), rec
    assert 17 - rec["end"] <= 1  # a diff every step: at most the step in flight is lost
    assert "bit-identical" in proc.stdout
