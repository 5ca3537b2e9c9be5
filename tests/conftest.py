"""Shared fixtures: a small byte-level corpus, composed configs, a single-process group."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def corpus_prefix(tmp_path_factory) -> str:
    """1 MiB of the standard library, byte-level: the data of every training test."""
    from megatier.data.corpus import build_dataset, stdlib_files

    prefix = str(tmp_path_factory.mktemp("corpus") / "stdlib_1mib")
    build_dataset(stdlib_files(2**20), prefix, tokenizer="byte")
    return prefix


@pytest.fixture
def compose_config():
    """compose_config(*overrides) -> Config, exactly as pretrain_gpt.py would build it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from megatier.config import register_configs

    register_configs()

    def _compose(*overrides: str):
        with initialize_config_dir(config_dir=str(REPO / "configs"), version_base="1.3"):
            return OmegaConf.to_object(compose(config_name="config", overrides=list(overrides)))

    return _compose


@pytest.fixture
def tiny_config(compose_config, corpus_prefix, tmp_path):
    """tiny_config(*overrides) -> a fast, offline `tiny` config writing under tmp_path."""

    def _make(*overrides: str):
        base = ["model=tiny", f"data.prefix={corpus_prefix}", "train.iters=10", "train.global_batch_size=4",
                "train.micro_batch_size=2", "train.eval_interval=5", "logging.wandb.mode=disabled",
                "logging.progress=false", f"logging.run_dir={tmp_path / 'run'}", "data.seq_len=64"]
        return compose_config(*base, *overrides)

    return _make


@pytest.fixture
def process_group():
    """A world-of-one gloo group for single-process tests of distributed code."""
    from megatier.parallel.state import build_parallel_state, init_process_group

    init_process_group("gloo", 60.0)
    yield build_parallel_state(1, 1, 60.0, torch.device("cpu"))
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", os.environ.get("WANDB_MODE", "offline"))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
