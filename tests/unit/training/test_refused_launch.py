"""A refused launch, through the command a user runs: its one line and exit status, and a run directory left
exactly as it was (no config.yaml of the refused config, no rotated or empty metrics file, no wandb run)."""
from __future__ import annotations

import hashlib
import os
import subprocess

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(180)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "MEGATIER_NODE_NAME", "GROUP_RANK")}
    env.update(OMP_NUM_THREADS="1")
    return env


def _train(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(REPO / ".venv" / "bin" / "megatier-train"), *args], capture_output=True, text=True,
                          env=_env(), cwd=REPO, timeout=170)


def _tree(folder: str) -> dict[str, str]:
    """Every file under ``folder`` (links as their targets) -> its content's hash."""
    found = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            path = os.path.join(root, name)
            if os.path.islink(path):
                found[path] = "-> " + os.readlink(path)
            elif os.path.isfile(path):
                with open(path, "rb") as f:
                    found[path] = hashlib.sha256(f.read()).hexdigest()
    return found


def test_a_relaunch_refused_for_a_changed_config_leaves_the_run_directory_as_it_was(tmp_path, corpus_prefix):
    args = ["model=tiny", f"data.prefix={corpus_prefix}", "data.seq_len=64", "train.iters=3",
            "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_interval=1000",
            "logging.wandb.mode=offline", "logging.progress=true", f"logging.run_dir={tmp_path}/run",
            "checkpoint=tiered", "checkpoint.tiers=[local]", f"checkpoint.local.root={tmp_path}/shm"]
    first = _train(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    before = _tree(f"{tmp_path}/run")
    assert {f"{tmp_path}/run/{n}" for n in ("config.yaml", "metrics.jsonl", "goodput.json")} <= set(before)
    assert "cannot write" not in first.stdout  # the ledger's first write makes the run directory

    refused = _train(*args, "optim.lr=0.001")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.splitlines() == [refused.stderr.strip()]  # the one line, no progress bar before it
    assert refused.stderr.startswith("refusing to recover: the checkpoints of job 'tiny' were written with another "
                                     "configuration (optim.lr: 0.0006 -> 0.001)")
    assert _tree(f"{tmp_path}/run") == before
