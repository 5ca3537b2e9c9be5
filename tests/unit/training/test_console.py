"""The training command's console (megatier.training.console), as megatier-train prints it: no library chatter,
MegaTier's warnings as one line, log lines clear of the progress bar."""
from __future__ import annotations

import os
import re
import subprocess

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(150)
PEER_SKIPPED = ("CheckpointConfigWarning: checkpoint.tiers includes peer but the job has 1 node; a same-node "
                "replica survives nothing Tier-1 does not, so the peer tier is skipped")


def _train(tmp_path, corpus_prefix, *extra: str, merged: bool = False, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                               "MASTER_PORT", "MEGATIER_NODE_NAME", "GROUP_RANK")}
    args = ["model=tiny", f"data.prefix={corpus_prefix}", "data.seq_len=64", "train.global_batch_size=4",
            "train.micro_batch_size=2", "logging.wandb.mode=disabled", f"logging.run_dir={tmp_path}/run",
            "checkpoint=tiered", f"checkpoint.local.root={tmp_path}/shm", *extra]
    return subprocess.run([str(REPO / ".venv" / "bin" / "megatier-train"), *args], text=True, cwd=REPO,
                          env={**clean, "OMP_NUM_THREADS": "1", **env}, timeout=140, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT if merged else subprocess.PIPE)


def test_no_botocore_chatter_and_a_checkpoint_warning_is_one_line(tmp_path, corpus_prefix):
    proc = _train(tmp_path, corpus_prefix, "checkpoint.remote.url=s3://bucket/p",
                  "checkpoint.remote.endpoint_url=http://127.0.0.1:9", AWS_ACCESS_KEY_ID="x",
                  AWS_SECRET_ACCESS_KEY="y")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout == ""  # botocore's "Found credentials in environment variables." is not the user's business
    lines = proc.stderr.splitlines()
    assert lines[0] == PEER_SKIPPED and len(lines) == 2 and lines[1].startswith("refusing to start job 'tiny'")


def test_a_log_line_is_never_glued_to_the_progress_bar(tmp_path, corpus_prefix):
    proc = _train(tmp_path, corpus_prefix, "train.iters=6", "logging.progress=true", "checkpoint.tiers=[local]",
                  "train.eval_interval=1000", "checkpoint.base_interval=5", merged=True)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "capture schedule:" in proc.stdout and "|" in proc.stdout  # a line logged while the bar is drawn
    # A frame of the bar, then more text; tqdm pads a frame shorter than the last one with spaces, which is not text.
    glued = re.search(r"\d+/\d+ \[[^\]\r\n]*\] *[^\s]", proc.stdout)
    assert glued is None, glued


def test_a_warning_every_rank_raises_is_printed_once_under_megatier_run(tmp_path, corpus_prefix):
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                               "MASTER_PORT", "MEGATIER_NODE_NAME", "GROUP_RANK")}
    cmd = [str(REPO / ".venv" / "bin" / "megatier-run"), "--standalone", "--nproc-per-node", "2", "-m",
           "megatier.train", "model=tiny", f"data.prefix={corpus_prefix}", "data.seq_len=64", "train.iters=2",
           "train.global_batch_size=4", "train.micro_batch_size=2", "logging.wandb.mode=disabled",
           "logging.progress=false", f"logging.run_dir={tmp_path}/run", "checkpoint=tiered",
           "checkpoint.tiers=[local,peer]", f"checkpoint.local.root={tmp_path}/shm"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**clean, "OMP_NUM_THREADS": "1"},
                          timeout=140)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [PEER_SKIPPED]
