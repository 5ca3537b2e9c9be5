"""The checkpoint config group: schema, presets and cross-field validation."""
from __future__ import annotations

import dataclasses
import warnings

import pytest

from megatier.checkpoint.policy.rules import (
    CheckpointConfigWarning,
    check_checkpoint_config,
    effective_checkpoint_config,
)
from megatier.config import CheckpointConfig, ConfigError

pytestmark = pytest.mark.timeout(30)


def leaf_keys(obj, prefix: str = "") -> set[str]:
    keys = set()
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            keys |= leaf_keys(value, f"{prefix}{f.name}.")
        else:
            keys.add(prefix + f.name)
    return keys


def test_schema_has_the_documented_keys_and_defaults():
    cfg = CheckpointConfig()
    assert leaf_keys(cfg) == {
        "enabled", "tiers", "base_interval", "mtbf_hours", "node_mtbf_hours", "auto_warmup_steps",
        "auto_max_interval", "diff.batch", "diff.compression", "diff.topk_ratio",
        "diff.small_threshold", "diff.per_step", "diff.threads", "peer.max_chunk_mib", "local.root", "local.keep_bases",
        "local.budget_gib",
        "remote.url", "remote.endpoint_url",
        "remote.keep_bases", "remote.base_every", "remote.fsync", "remote.drain_timeout_s", "remote.lease_s", "job_id",
        "memory_budget_gib", "allow_fresh_start", "final_base", "allow_changes", "base_capture", "capture_steps",
        "capture_schedule", "last_resort", "checkfree.lr_scale", "checkfree.init"}
    assert (cfg.base_interval, cfg.diff.batch, cfg.diff.compression, cfg.diff.topk_ratio) == (50, 5, "adaptive", 0.01)
    assert (cfg.diff.small_threshold, cfg.peer.max_chunk_mib, cfg.remote.keep_bases) == (100_000, 256, 2)
    assert cfg.local.root.startswith("/dev/shm/") and cfg.remote.url == "checkpoints"
    assert cfg.allow_fresh_start is False and cfg.remote.fsync is True
    assert (cfg.base_capture, cfg.capture_steps) == ("snapshot", 4)
    assert cfg.remote.base_every == 1
    assert (cfg.last_resort, cfg.checkfree.lr_scale, cfg.checkfree.init) == ("stop", 1.1, "weighted")


def test_tiered_preset_composes_and_validates(compose_config, tmp_path):
    cfg = compose_config("checkpoint=tiered", "logging.name=run7", f"checkpoint.local.root={tmp_path / 'shm'}")
    ck = cfg.checkpoint
    assert ck.enabled and ck.tiers == ["local", "peer", "remote"] and ck.job_id == "run7"
    check_checkpoint_config(ck)
    assert effective_checkpoint_config(ck, num_nodes=2) == ck
    assert compose_config().checkpoint.enabled is False


def test_s3_url_with_endpoint_is_accepted(tmp_path):
    cfg = CheckpointConfig(enabled=True, job_id="j", local=dataclasses.replace(CheckpointConfig().local,
                                                                             root=str(tmp_path)))
    cfg.remote.url, cfg.remote.endpoint_url = "s3://my-bucket/runs", "http://127.0.0.1:9000"
    check_checkpoint_config(cfg)
    assert effective_checkpoint_config(cfg, num_nodes=2).remote.url == "s3://my-bucket/runs"


@pytest.mark.parametrize("overrides, fields", [
    (["checkpoint.base_interval=52"], ["checkpoint.base_interval=52", "checkpoint.diff.batch=5", "base_interval=50"]),
    (["checkpoint.base_interval=0"], ["checkpoint.base_interval=0"]),
    (["checkpoint.diff.compression=zstd"], ["checkpoint.diff.compression='zstd'", "adaptive"]),
    (["checkpoint.diff.topk_ratio=0"], ["checkpoint.diff.topk_ratio"]),
    (["checkpoint.tiers=[local,cloud]"], ["'cloud'", "local, peer, remote"]),
    (["checkpoint.tiers=[peer,remote]"], ["peer without local"]),
    (["checkpoint.tiers=[local,local]"], ["twice"]),
    (["checkpoint.tiers=[]"], ["checkpoint.tiers is empty"]),
    (["checkpoint.remote.url=gs://bucket/x"], ["checkpoint.remote.url='gs://bucket/x'", "scheme 'gs'"]),
    (["checkpoint.remote.url=s3://Bad_Bucket/x"], ["'Bad_Bucket'", "bucket name"]),
    (["checkpoint.remote.endpoint_url=http://127.0.0.1:9000"], ["endpoint_url", "not s3://"]),
    (["checkpoint.remote.keep_bases=0"], ["checkpoint.remote.keep_bases=0"]),
    (["checkpoint.remote.base_every=0"], ["checkpoint.remote.base_every=0", "integer >= 1"]),
    (["checkpoint.remote.base_every=-2"], ["checkpoint.remote.base_every=-2", "integer >= 1"]),
    (["checkpoint.remote.base_every=2", "checkpoint.tiers=[remote]"], ["checkpoint.remote.base_every=2",
                                                                      "needs the local tier"]),
    (["checkpoint.job_id=a/b"], ["checkpoint.job_id='a/b'"]),
    (["checkpoint.local.root={tmp}/a_file/shm"], ["checkpoint.local.root=", "a_file is not a writable directory"]),
    (["checkpoint.memory_budget_gib=0"], ["checkpoint.memory_budget_gib=0"]),
    (["checkpoint.peer.max_chunk_mib=0"], ["checkpoint.peer.max_chunk_mib=0"]),
    (["checkpoint.base_capture=lazy"], ["checkpoint.base_capture='lazy'", "snapshot, spread"]),
    (["checkpoint.capture_steps=60"], ["checkpoint.capture_steps=60", "checkpoint.base_interval=50"]),
    (["checkpoint.capture_steps=0"], ["checkpoint.capture_steps=0"]),
    (["checkpoint.last_resort=pray"], ["checkpoint.last_resort='pray'", "stop, checkfree"]),
    (["checkpoint.checkfree.init=zeros"], ["checkpoint.checkfree.init='zeros'", "weighted, copy, random"]),
    (["checkpoint.checkfree.lr_scale=0"], ["checkpoint.checkfree.lr_scale=0", "positive"]),
    (["checkpoint.diff.threads=-1"], ["checkpoint.diff.threads=-1", ">= 0"]),
])
def test_invalid_combinations_name_the_field(compose_config, tmp_path, overrides, fields):
    (tmp_path / "a_file").write_text("not a directory")
    base = ["checkpoint=tiered", f"checkpoint.local.root={tmp_path}"]
    cfg = compose_config(*base, *(o.format(tmp=tmp_path) for o in overrides))
    with pytest.raises(ConfigError) as err:
        check_checkpoint_config(cfg.checkpoint)
    message = str(err.value)
    assert "\n" not in message
    for field in fields:
        assert field in message


@pytest.mark.parametrize("every", [1.5, True, "2"])
def test_base_every_must_be_an_integer(tmp_path, every):
    """Hydra's schema refuses a non-integer override first; a config built in Python meets this check."""
    cfg = CheckpointConfig(enabled=True, job_id="j", local=dataclasses.replace(CheckpointConfig().local,
                                                                             root=str(tmp_path)))
    cfg.remote.base_every = every
    with pytest.raises(ConfigError, match=r"^checkpoint\.remote\.base_every=.* must be an integer >= 1 [^\n]*$"):
        check_checkpoint_config(cfg)
    cfg.remote.base_every = 3
    check_checkpoint_config(cfg)


def test_peer_tier_on_one_node_is_dropped_with_a_warning(compose_config, tmp_path):
    cfg = compose_config("checkpoint=tiered", f"checkpoint.local.root={tmp_path}").checkpoint
    with pytest.warns(CheckpointConfigWarning, match="1 node.*peer tier is skipped"):
        effective = effective_checkpoint_config(cfg, num_nodes=1)
    assert effective.tiers == ["local", "remote"] and cfg.tiers == ["local", "peer", "remote"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert effective_checkpoint_config(cfg, num_nodes=2).tiers == ["local", "peer", "remote"]


def test_disabled_config_is_returned_unchecked():
    cfg = CheckpointConfig(enabled=False, base_interval=-1)
    check_checkpoint_config(cfg)
    assert effective_checkpoint_config(cfg, num_nodes=1) is cfg


def test_a_rejected_checkpoint_config_creates_nothing(tiny_config, tmp_path):
    """Config errors surface before any side effect: no process group, no run directory, no Tier-1 area."""
    import torch.distributed as dist

    from megatier.training.trainer import Trainer

    cfg = tiny_config("checkpoint=tiered", "checkpoint.base_interval=7", f"checkpoint.local.root={tmp_path / 'shm'}",
                      f"checkpoint.remote.url={tmp_path / 't3'}")
    with pytest.raises(ConfigError, match="checkpoint.base_interval=7"):
        Trainer(cfg)
    assert not dist.is_initialized()
    assert not (tmp_path / "run").exists() and not (tmp_path / "shm").exists() and not (tmp_path / "t3").exists()


def test_the_run_records_the_config_it_uses(tiny_config, tmp_path):
    """On one node the peer tier is dropped with a warning, and config.yaml says so: no silent copy."""
    import yaml

    from megatier.training.trainer import Trainer

    cfg = tiny_config("checkpoint=tiered", f"checkpoint.local.root={tmp_path / 'shm'}",
                      f"checkpoint.remote.url={tmp_path / 't3'}", "train.iters=2")
    with pytest.warns(CheckpointConfigWarning, match="peer tier is skipped"):
        trainer = Trainer(cfg)
    try:
        assert [t.label for t in trainer.checkpointer.ctx.tiers if t.saves] == ["tier1", "tier3"]
        # Restore still reads the replica area an earlier launch's ring may have left on this node.
        assert [t.label for t in trainer.checkpointer.ctx.tiers if not t.saves] == ["tier2"]
        trainer.train()  # the run directory is written with the first record
        written = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
        assert written["checkpoint"]["tiers"] == ["local", "remote"] == trainer.cfg.checkpoint.tiers
    finally:
        trainer.close()


def test_auto_interval_needs_one_mtbf_and_a_warmup_in_whole_batches(tmp_path):
    local = dataclasses.replace(CheckpointConfig().local, root=str(tmp_path))

    def check(interval="auto", **kw):
        check_checkpoint_config(CheckpointConfig(enabled=True, job_id="j", local=local, base_interval=interval, **kw))

    check(mtbf_hours=12.0)
    check(node_mtbf_hours=1000.0, auto_warmup_steps=20)
    with pytest.raises(ConfigError, match="exactly one of checkpoint.mtbf_hours"):
        check()
    with pytest.raises(ConfigError, match="got mtbf_hours, node_mtbf_hours"):
        check(mtbf_hours=1.0, node_mtbf_hours=10.0)
    with pytest.raises(ConfigError, match="mtbf_hours=-1.0 must be positive"):
        check(mtbf_hours=-1.0)
    with pytest.raises(ConfigError, match="auto_warmup_steps=7 must be a positive multiple"):
        check(mtbf_hours=1.0, auto_warmup_steps=7)
    with pytest.raises(ConfigError, match="auto_max_interval=10 is below the smallest interval auto can take, 15"):
        check(mtbf_hours=1.0, auto_max_interval=10)
    with pytest.raises(ConfigError, match="base_interval='often' must be a positive number of steps or auto"):
        check("often")
