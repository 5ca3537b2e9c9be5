"""A new job whose Tier-3 does not answer at start-up, through megatier-train: nothing in node memory tells a new
job from one whose checkpoints are only in Tier-3, so the launch is refused in one line (exit 2) unless
checkpoint.allow_fresh_start, which trains from scratch with Tier-3 behind (exit 3)."""
from __future__ import annotations

import os
import subprocess

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(150)
UNREACHABLE = "http://127.0.0.1:9"  # the discard port: nothing listens


def _train(tmp_path, corpus_prefix, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "MEGATIER_NODE_NAME", "GROUP_RANK")}
    env.update(OMP_NUM_THREADS="1", AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="y")
    args = ["model=tiny", f"data.prefix={corpus_prefix}", "data.seq_len=64", "train.iters=3",
            "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_interval=1000",
            "logging.wandb.mode=disabled", "logging.progress=false", f"logging.run_dir={tmp_path}/run",
            "checkpoint=tiered", "checkpoint.tiers=[local,remote]", f"checkpoint.local.root={tmp_path}/shm",
            "checkpoint.remote.url=s3://bucket/p", f"checkpoint.remote.endpoint_url={UNREACHABLE}",
            "checkpoint.remote.drain_timeout_s=1", *extra]
    return subprocess.run([str(REPO / ".venv" / "bin" / "megatier-train"), *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=140)


def test_a_new_job_with_tier3_unreachable_is_refused_in_one_line(tmp_path, corpus_prefix):
    proc = _train(tmp_path, corpus_prefix)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    line = proc.stderr.strip()
    assert proc.stderr.splitlines() == [line]
    assert line.startswith("refusing to start job 'tiny': Tier-3 at s3://bucket/p/tiny/ is unreachable at start-up")
    assert line.endswith("make Tier-3 reachable, or set checkpoint.allow_fresh_start=true to start from scratch")
    assert "starts from node memory" not in proc.stdout
    assert not os.path.exists(f"{tmp_path}/run")


def test_allow_fresh_start_trains_with_tier3_behind_and_says_so_plainly(tmp_path, corpus_prefix):
    proc = _train(tmp_path, corpus_prefix, "checkpoint.allow_fresh_start=true")
    assert proc.returncode == 3, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "starting job 'tiny' from scratch (checkpoint.allow_fresh_start=true)" in proc.stdout
    assert "set checkpoint.allow_fresh_start" not in proc.stdout + proc.stderr  # it is set already
    assert proc.stderr.splitlines()[-1] == ("checkpoints: Tier-3 is 3 units behind; the last durable version is "
                                            "none yet (see the warning above)")
