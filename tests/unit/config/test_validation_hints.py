"""Validation's lines as megatier-train prints them for settings a new user tries: a data.prefix that names a
file of the dataset, a model.init_from of either architecture, sequence parallelism without tensor parallelism."""
from __future__ import annotations

import os
import subprocess

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(120)


def _train(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "MEGATIER_NODE_NAME", "GROUP_RANK")}
    return subprocess.run([str(REPO / ".venv" / "bin" / "megatier-train"), "model=tiny", *args], capture_output=True,
                          text=True, cwd=REPO, env={**env, "OMP_NUM_THREADS": "1"}, timeout=110)


@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_a_data_prefix_naming_a_file_gets_the_prefix_without_its_suffix(corpus_prefix, suffix):
    proc = _train(f"data.prefix={corpus_prefix}{suffix}")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"config error: data.prefix='{corpus_prefix}{suffix}' names one of the dataset's "
                                   f"files; data.prefix is their path without .bin or .idx: "
                                   f"data.prefix={corpus_prefix}")


def test_a_missing_init_from_names_both_architectures(tmp_path):
    proc = _train(f"model.init_from={tmp_path}/none")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (f"config error: model.init_from='{tmp_path}/none': {tmp_path}/none/config.json "
                                   f"does not exist; give a Hugging Face GPT-2 or Llama (or Mixtral, Qwen2, "
                                   f"Qwen2-MoE) directory (save_pretrained or megatier-convert export), a job as "
                                   f"torchtitan:<dir>, torch_dist:<dir> or megatron_legacy:<dir>, or unset "
                                   f"model.init_from")


def test_sequence_parallel_at_tp_1_says_it_does_nothing(tmp_path, corpus_prefix):
    proc = _train("parallel.sequence_parallel=true", f"data.prefix={corpus_prefix}", "data.seq_len=64",
                  "train.iters=1", "train.global_batch_size=2", "train.micro_batch_size=2", "logging.progress=false",
                  "logging.wandb.mode=disabled", f"logging.run_dir={tmp_path}/run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.splitlines() == [
        "ConfigWarning: parallel.sequence_parallel=true does nothing at parallel.tp=1: it cuts activations across "
        "the tensor-parallel ranks; set parallel.tp > 1, or leave it unset"]
