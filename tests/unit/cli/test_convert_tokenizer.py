"""megatier-convert export without --data-prefix finds the run's data (and so its tokenizer) through the run
directory's config.yaml, as a user who trained with logging.name=<job> and exports that job expects; data found
nowhere is a warning, not a silent omission."""
from __future__ import annotations

import os
import subprocess

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(180)


def _run(tool: str, *args: str, cwd) -> subprocess.CompletedProcess:
    """``tool`` with a corpus cache of its own: the test's data is the 1 MiB default corpus, which another test
    may have cached, and the export would find it there."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "MEGATIER_NODE_NAME", "GROUP_RANK")}
    return subprocess.run([str(REPO / ".venv" / "bin" / tool), *args], capture_output=True, text=True, cwd=cwd,
                          env={**env, "OMP_NUM_THREADS": "1", "MEGATIER_CACHE": str(cwd / "no-cache")},
                          timeout=170)


def _tokenizer_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("tokenizer:"))


def test_export_finds_the_data_through_the_run_directory(tmp_path, corpus_prefix):
    trained = _run("megatier-train", "model=tiny", f"data.prefix={corpus_prefix}", "data.seq_len=64",
                   "train.iters=2", "train.global_batch_size=2", "train.micro_batch_size=2", "logging.name=job7",
                   "logging.wandb.mode=disabled", "logging.progress=false", "checkpoint=tiered",
                   "checkpoint.tiers=[local]", f"checkpoint.local.root={tmp_path}/shm", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert (tmp_path / "runs" / "job7" / "config.yaml").is_file()

    found = _run("megatier-convert", "export", "--job-id", "job7", "--local-root", f"{tmp_path}/shm", "hf",
                 cwd=tmp_path)
    assert found.returncode == 0, found.stderr
    assert _tokenizer_line(found.stdout).startswith("tokenizer: byte of the run's data")
    assert found.stderr == ""

    elsewhere = tmp_path / "elsewhere"  # no runs/job7 here: said on stderr too
    elsewhere.mkdir()
    lost = _run("megatier-convert", "export", "--job-id", "job7", "--local-root", f"{tmp_path}/shm", "hf",
                cwd=elsewhere)
    assert lost.returncode == 0, lost.stderr
    line = _tokenizer_line(lost.stdout)
    assert line.startswith("tokenizer: none: the run's data is not the default corpus and runs/job7/config.yaml")
    assert lost.stderr == f"warning: {line}\n"
