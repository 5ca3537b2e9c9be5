"""megatier-run ends a torchrun launch with the workers' status: a refusal is its one line and exit 2, Ctrl-C is
the resume line and 130, a crash is torchrun's summary of the failed rank (no launcher traceback)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(240)


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "MEGATIER_NODE_NAME", "GROUP_RANK")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return env


def _launch(procs: int, *module_args: str) -> list[str]:
    return [sys.executable, "-m", "megatier.cli.run", "--standalone", "--nproc-per-node", str(procs), "-m",
            *module_args]


def test_a_refusal_is_its_one_line_and_exit_2():
    proc = subprocess.run(_launch(2, "megatier.train", "model=tiny", "+train.iter=5"), capture_output=True,
                          text=True, env=_env(), cwd=REPO, timeout=200)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == ("config error: unknown config key train.iter (in the override "
                                   "'+train.iter=5'); did you mean train.iters?")


def test_a_crashed_worker_gets_torchruns_summary_and_its_status():
    proc = subprocess.run(_launch(1, "megatier.no_such_module"), capture_output=True, text=True, env=_env(),
                          cwd=REPO, timeout=200)
    assert proc.returncode == 1
    assert "No module named megatier.no_such_module" in proc.stderr  # the worker's own error
    assert "Root Cause" in proc.stderr and "exitcode  : 1" in proc.stderr  # which rank failed, and how
    assert "launcher/api.py" not in proc.stderr  # not the launcher's traceback


def test_ctrl_c_drains_and_ends_with_130_and_the_resume_line(tmp_path, corpus_prefix):
    args = ["model=tiny", f"data.prefix={corpus_prefix}", "data.seq_len=64", "train.global_batch_size=4",
            "train.micro_batch_size=2", "train.eval_interval=1000", "logging.wandb.mode=disabled",
            "logging.progress=false", "logging.name=run", f"logging.run_dir={tmp_path}/run", "train.iters=100000",
            "checkpoint=tiered", "checkpoint.tiers=[local]", f"checkpoint.local.root={tmp_path}/shm"]
    proc = subprocess.Popen(_launch(2, "megatier.train", *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=_env(), cwd=REPO, start_new_session=True)
    metrics = f"{tmp_path}/run/metrics.jsonl"
    deadline = time.monotonic() + 150
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0) and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the launcher and its workers
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and err.count("; relaunch the same command to resume from step ") == 1, err


def test_a_refusal_after_the_process_groups_exist_is_one_line_from_rank_0(tmp_path):
    # Both ranks refuse (rank 0 found the remote url unusable and told the other), only rank 0 prints.
    overrides = ["model=tiny", "train.iters=3", "logging.wandb.mode=disabled", "logging.progress=false",
                 f"logging.run_dir={tmp_path}/run", "checkpoint=tiered", "checkpoint.tiers=[remote]",
                 "checkpoint.remote.url=/dev/null/ckpt"]
    proc = subprocess.run(_launch(2, "megatier.train", *overrides), capture_output=True, text=True, env=_env(),
                          cwd=REPO, timeout=200)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        "config error: checkpoint.remote.url='/dev/null/ckpt' is not usable: cannot create checkpoint directory "
        "/dev/null/ckpt/tiny: Not a directory; check the path and its permissions"], proc.stderr[-3000:]
