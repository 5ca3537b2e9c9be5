"""Shared fixtures: a small byte-level corpus, composed configs, a single-process group, S3 on moto."""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatier.checkpoint.storage.store import RetryPolicy
from megatier.checkpoint.tiers.remote import open_remote_store

REPO = Path(__file__).resolve().parents[1]
FAST_RETRY = RetryPolicy(attempts=2, base_delay_s=0.01, max_delay_s=0.05)


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


@pytest.fixture(scope="session")
def moto_endpoint():
    """http://127.0.0.1:<port> of a moto S3 server running in a thread for the whole session."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def aws_env(monkeypatch):
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


@pytest.fixture
def s3_url(moto_endpoint, aws_env):
    """A fresh bucket; returns (url, endpoint)."""
    import boto3

    bucket = f"bkt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/runs", moto_endpoint


@pytest.fixture(params=["dir", "s3"])
def remote_store(request, tmp_path):
    """The job's Tier-3 store through open_remote_store, once per backend."""
    if request.param == "dir":
        return open_remote_store(str(tmp_path / "remote"), "job1")
    url, endpoint = request.getfixturevalue("s3_url")
    return open_remote_store(url, "job1", endpoint_url=endpoint, retry=FAST_RETRY)
