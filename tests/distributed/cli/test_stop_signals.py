"""Ctrl-C and a scheduler's SIGTERM stop a job cleanly under every launcher: the workers finish their step, drain,
rank 0 says where to resume, the launch ends with 130 after Ctrl-C and 0 after SIGTERM (Megatron's
--exit-signal-handler), and the relaunch continues the job (no failure booked) to the same state as a run never
stopped."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(300)

STATUS = {signal.SIGINT: 130, signal.SIGTERM: 0}
LINE = {signal.SIGINT: "interrupted at step {0}; relaunch the same command to resume from step {0}",
        signal.SIGTERM: "terminated (SIGTERM) at step {0}; relaunch the same command to resume from step {0}"}


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "MEGATIER_NODE_NAME", "GROUP_RANK")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return env


def _args(work, corpus_prefix, iters: int) -> list[str]:
    return ["model=tiny", f"data.prefix={corpus_prefix}", "data.seq_len=64", "train.global_batch_size=4",
            "train.micro_batch_size=2", "train.eval_interval=1000", "logging.wandb.mode=disabled",
            "logging.progress=false", "logging.name=job", f"logging.run_dir={work}/run", f"train.iters={iters}",
            "optim.decay_iters=1000", "checkpoint=tiered", "checkpoint.tiers=[local]",
            f"checkpoint.local.root={work}/shm", "checkpoint.diff.compression=fp32"]


def _command(launcher: str, args: list[str]) -> list[str]:
    if launcher == "megatier-train":
        return [sys.executable, "-m", "megatier.train", *args]
    if launcher == "megatier-run":
        return [sys.executable, "-m", "megatier.cli.run", "--standalone", "--nproc-per-node", "2", "-m",
                "megatier.train", *args]
    return [sys.executable, "-m", "megatier.cli.launch", "--nodes", "2", "--procs-per-node", "1", "--", "-m",
            "megatier.train", *args]


def _records(work) -> list[dict]:
    with open(f"{work}/run/metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def _stopped(launcher: str, work, corpus_prefix, sig: signal.Signals) -> subprocess.CompletedProcess:
    """The job started under ``launcher``, sent ``sig`` once it trains: by a terminal's Ctrl-C, the launcher's
    process group (megatier-launch's nodes run in sessions of their own); by a scheduler, every process."""
    proc = subprocess.Popen(_command(launcher, _args(work, corpus_prefix, 100000)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO, start_new_session=True)
    metrics = f"{work}/run/metrics.jsonl"
    deadline = time.monotonic() + 150
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0) and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, sig)
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _run(launcher: str, work, corpus_prefix, iters: int) -> subprocess.CompletedProcess:
    return subprocess.run(_command(launcher, _args(work, corpus_prefix, iters)), capture_output=True, text=True,
                          env=_env(), cwd=REPO, timeout=200)


@pytest.mark.parametrize("launcher", [pytest.param("megatier-train", marks=pytest.mark.slow), "megatier-run",
                                      pytest.param("megatier-launch", marks=pytest.mark.slow)])
@pytest.mark.parametrize("sig", [pytest.param(signal.SIGINT, id="ctrl-c"),
                                 pytest.param(signal.SIGTERM, id="sigterm", marks=pytest.mark.slow)])
def test_a_signal_is_a_clean_stop_and_the_relaunch_resumes_bit_exact(tmp_path, corpus_prefix, launcher, sig):
    stopped = _stopped(launcher, tmp_path / "job", corpus_prefix, sig)
    assert stopped.returncode == STATUS[sig], stopped.stderr[-3000:]
    summary = _records(tmp_path / "job")[-1]
    step = summary["step"]
    assert summary["event"] == "summary" and summary["checkpoint_saved_step"] == step  # drained: durable
    assert stopped.stderr.count(LINE[sig].format(step)) == 1, stopped.stderr[-3000:]
    assert "Traceback" not in stopped.stderr and "stopping all nodes" not in stopped.stderr

    again = _run(launcher, tmp_path / "job", corpus_prefix, step + 2)
    assert again.returncode == 0, again.stderr[-3000:]
    rec = next(r for r in _records(tmp_path / "job") if r.get("event") == "recovery")
    assert (rec["end"], rec["steps_lost"], rec["failure_class"]) == (step, 0, "none")  # no failure booked
    assert _run(launcher, tmp_path / "ref", corpus_prefix, step + 2).returncode == 0
    assert _records(tmp_path / "job")[-1]["state_digest"] == _records(tmp_path / "ref")[-1]["state_digest"]


def test_exit_duration_under_megatier_run_stops_every_rank_after_the_same_step(tmp_path, corpus_prefix):
    # Rank 0 alone reads the clock; were the ranks to stop after different steps, the job would hang or crash.
    # The clock starts with the launch, as Megatron's does, so on a loaded box the start-up can take most of it:
    # one step trained before the limit is enough to show the ranks agree.
    args = [*_args(tmp_path / "job", corpus_prefix, 100000), "train.exit_duration_in_mins=0.5"]
    proc = subprocess.run(_command("megatier-run", args), capture_output=True, text=True, env=_env(), cwd=REPO,
                          timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _records(tmp_path / "job")[-1]
    step = summary["step"]
    assert summary["event"] == "summary" and summary["checkpoint_saved_step"] == step and step >= 1
    assert proc.stderr.count(f"stopped by train.exit_duration_in_mins=0.5 at step {step}; relaunch the same "
                             f"command to resume from step {step}") == 1, proc.stderr[-3000:]
    again = _run("megatier-run", tmp_path / "job", corpus_prefix, step + 1)
    assert again.returncode == 0, again.stderr[-3000:]
    rec = next(r for r in _records(tmp_path / "job") if r.get("event") == "recovery")
    assert (rec["end"], rec["steps_lost"], rec["failure_class"]) == (step, 0, "none")
