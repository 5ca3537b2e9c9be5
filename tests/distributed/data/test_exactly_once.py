"""Every global sample is trained once and in order through a job's transitions: a clean stop and its resume,
a lost node that shrinks dp in place (4 -> 2), elastic relaunches on fewer nodes with resharded restores (to
pp=2, then to tp=2), and training longer than first planned. Each process logs the samples of every step it trains
(MEGATIER_SAMPLE_LOG, :mod:`megatier.data.sample_log`); what the job trained at each step, its newest take,
must be what a fault-free run trained there."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatier.data.sample_log import ENV, consumed_by_step
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(900)

JOB = ["model=tiny", "parallel.tp=1", "data.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=2",
       "checkpoint=tiered", "checkpoint.base_interval=10", "checkpoint.diff.compression=fp32",
       "parallel.timeout_s=30", "logging.wandb.mode=disabled", "logging.progress=false", "optim.decay_iters=100"]


def launch(work: Path, log: Path, nodes: int, procs: int, *overrides: str, crash_at: str = "",
           spares: int = 0) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "MEGATIER_NODE_NAME")}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled", MEGATIER_CRASH_AT=crash_at, **{ENV: str(log)})
    cmd = [sys.executable, "-m", "megatier.cli.launch", "--nodes", str(nodes), "--procs-per-node", str(procs),
           "--recovery", "inprocess", "--spares-per-node", str(spares), "--spare-nodes", "0", "--",
           str(REPO / "pretrain_gpt.py"), *JOB, f"checkpoint.local.root={work}/shm",
           f"checkpoint.remote.url={work}/remote", f"logging.run_dir={work}/run", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


@pytest.mark.parametrize("data", ["prefix", pytest.param("blend", marks=pytest.mark.slow)])
def test_every_sample_is_trained_once_in_order_through_stops_shrinks_and_reshards(tmp_path, request, data):
    data_args = request.getfixturevalue("blend") if data == "blend" else []
    reference = tmp_path / "reference_samples"
    launch(tmp_path / "reference", reference, 2, 2, "train.iters=30", "checkpoint.enabled=false", *data_args)
    expected = consumed_by_step(reference)
    assert sorted(expected) == list(range(1, 31)) and all(len(s) == 8 for s in expected.values())
    assert len({s for samples in expected.values() for s in samples}) == 30 * 8  # no sample twice in an epoch

    job, log = tmp_path / "job", tmp_path / "job_samples"
    launch(job, log, 2, 2, "train.iters=20", "train.exit_interval=6", *data_args)  # a clean stop after step 6
    assert max(consumed_by_step(log)) == 6
    # node1 lost with its agent after step 11, no spare: dp 4 -> 2 in place
    shrunk = launch(job, log, 2, 2, "train.iters=20", *data_args, crash_at="train.step_end:11:2:node")
    assert "(1,1,4) -> (1,1,2)" in shrunk.stdout + shrunk.stderr, (shrunk.stdout + shrunk.stderr)[-3000:]
    assert max(consumed_by_step(log)) == 20
    # One node: resharded to pp=2 (dp 2 -> 1), five steps longer; then to tp=2 (pp 2 -> 1), five more.
    launch(job, log, 1, 2, "train.iters=25", "parallel.pp=2", *data_args)
    assert max(consumed_by_step(log)) == 25
    launch(job, log, 1, 2, "train.iters=30", "parallel.tp=2", *data_args)
    got = consumed_by_step(log)
    assert sorted(got) == list(range(1, 31))
    assert {s: got[s] for s in got if got[s] != expected[s]} == {}
