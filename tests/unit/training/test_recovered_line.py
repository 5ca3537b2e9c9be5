"""The console's recovery line says the launch's own failure class, as its record does: a relaunch after a
clean exit continues the job (no failure), one after a killed launch recovers from a software failure."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(200)


def _args(tmp_path, corpus_prefix, iters: int) -> list[str]:
    return [str(REPO / ".venv" / "bin" / "megatier-train"), "model=tiny", f"data.prefix={corpus_prefix}",
            "data.seq_len=64", f"train.iters={iters}", "train.global_batch_size=4", "train.micro_batch_size=2",
            "train.eval_interval=1000", "logging.wandb.mode=disabled", "logging.progress=false",
            f"logging.run_dir={tmp_path}/run", "checkpoint=tiered", "checkpoint.tiers=[local]",
            f"checkpoint.local.root={tmp_path}/shm", "checkpoint.base_interval=5", "checkpoint.diff.compression=fp32"]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "MEGATIER_NODE_NAME", "GROUP_RANK")}
    return {**env, "OMP_NUM_THREADS": "1"}


def _recovered(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("recovered v"))


def _record(tmp_path) -> dict:
    with open(f"{tmp_path}/run/metrics.jsonl") as f:
        return next(r for r in map(json.loads, f) if r.get("event") == "recovery")


def test_a_relaunch_after_a_clean_exit_says_no_failure(tmp_path, corpus_prefix):
    first = subprocess.run(_args(tmp_path, corpus_prefix, 3), capture_output=True, text=True, env=_env(), cwd=REPO,
                           timeout=100)
    assert first.returncode == 0, first.stderr[-2000:]
    again = subprocess.run(_args(tmp_path, corpus_prefix, 5), capture_output=True, text=True, env=_env(), cwd=REPO,
                           timeout=100)
    assert again.returncode == 0, again.stderr[-2000:]
    assert _record(tmp_path)["failure_class"] == "none"
    assert _recovered(again.stdout).startswith("recovered v3 -> E=3 (no failure: the last launch ended cleanly) ")


def test_a_relaunch_after_a_kill_says_software(tmp_path, corpus_prefix):
    proc = subprocess.Popen(_args(tmp_path, corpus_prefix, 400), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, env=_env(), cwd=REPO)
    metrics, deadline = f"{tmp_path}/run/metrics.jsonl", time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:  # past the first base and a diff batch
        if os.path.exists(metrics) and sum(1 for _ in open(metrics)) > 8:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    again = subprocess.run(_args(tmp_path, corpus_prefix, 12), capture_output=True, text=True, env=_env(), cwd=REPO,
                           timeout=100)
    assert again.returncode == 0, again.stderr[-2000:]
    cls = _record(tmp_path)["failure_class"]
    assert cls == "software"
    assert f"({cls}) from " in _recovered(again.stdout)
