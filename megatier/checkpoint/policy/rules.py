"""Cross-field checks of the ``checkpoint`` config group.

- :func:`check_checkpoint_config` runs with every other check, before any side
  effect; it raises :class:`~megatier.config.ConfigError` with a one-line
  reason naming the field and a fix.
- :func:`effective_checkpoint_config` runs once the topology is known: on a
  one-node job it drops the peer tier (a replica on the same node survives
  nothing Tier-1 does not) with a :class:`CheckpointConfigWarning`. The caller
  makes the result *the* run's config, the one it writes to config.yaml.

Rules beyond per-field ranges:
- ``base_interval`` must be a multiple of ``diff.batch``. Then every diff batch
  lies inside one base interval, every base version ends a batch, and replay
  from any base starts at a batch boundary; reclamation can drop whole batches.
- ``peer`` requires ``local``: a replica lives in the holder node's Tier-1 area.
- ``remote.endpoint_url`` only makes sense with an ``s3://`` url.
- ``remote.base_every`` > 1 needs ``local``: node memory keeps the bases Tier-3 skips.
"""
from __future__ import annotations

import dataclasses
import os
import re
import tempfile
import warnings
from typing import Optional
from urllib.parse import urlparse

from megatier.checkpoint.policy.interval import auto_min_interval
from megatier.config.schema import CheckpointConfig, ConfigError
from megatier.config.schema import require as _require

TIERS = ("local", "peer", "remote")
COMPRESSIONS = ("adaptive", "int8", "topk", "bf16", "fp32")
# A job id becomes a directory name and part of every S3 key.
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# S3 bucket naming rules (lowercase letters, digits, dots, hyphens; 3-63 characters).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class CheckpointConfigWarning(UserWarning):
    """A checkpoint setting that cannot take effect on this job and was adjusted."""


def _check_tiers(cfg: CheckpointConfig) -> None:
    tiers = list(cfg.tiers)
    _require(len(tiers) > 0, "checkpoint.tiers is empty; list at least one of local, peer, remote "
                             "(or set checkpoint.enabled=false)")
    for tier in tiers:
        _require(tier in TIERS, f"checkpoint.tiers contains {tier!r}; valid tiers are {', '.join(TIERS)}")
    _require(len(set(tiers)) == len(tiers), f"checkpoint.tiers={tiers} lists a tier twice; list each once")
    _require("peer" not in tiers or "local" in tiers,
             "checkpoint.tiers has peer without local; a peer replica is kept in the holder's Tier-1 area, "
             "so add local")


BASE_CAPTURES = ("snapshot", "spread")
CAPTURE_SCHEDULES = ("checkflow", "none")
LAST_RESORTS = ("stop", "checkfree")
CHECKFREE_INITS = ("weighted", "copy", "random")


def _check_interval(cfg: CheckpointConfig) -> None:
    d = cfg.diff
    _require(d.batch > 0, f"checkpoint.diff.batch={d.batch} must be positive")
    if cfg.base_interval == "auto":
        _check_auto(cfg)
        return
    _require(isinstance(cfg.base_interval, int) and not isinstance(cfg.base_interval, bool)
             and cfg.base_interval > 0,
             f"checkpoint.base_interval={cfg.base_interval!r} must be a positive number of steps or auto")
    _require(cfg.base_interval % d.batch == 0,
             f"checkpoint.base_interval={cfg.base_interval} is not a multiple of checkpoint.diff.batch={d.batch}; "
             f"diff batches must not straddle a base, so choose e.g. base_interval="
             f"{max(d.batch, cfg.base_interval // d.batch * d.batch)}")
    _require(1 <= cfg.capture_steps <= cfg.base_interval,
             f"checkpoint.capture_steps={cfg.capture_steps} must be between 1 and checkpoint.base_interval="
             f"{cfg.base_interval}: a spread base is captured over the steps that end at its version")


def _check_auto(cfg: CheckpointConfig) -> None:
    given = [k for k in ("mtbf_hours", "node_mtbf_hours") if getattr(cfg, k) is not None]
    _require(len(given) == 1, "checkpoint.base_interval=auto needs the failure rate it optimises for: set exactly "
             f"one of checkpoint.mtbf_hours (the cluster's) or checkpoint.node_mtbf_hours (each node's); got "
             f"{', '.join(given) or 'neither'}")
    _require(getattr(cfg, given[0]) > 0, f"checkpoint.{given[0]}={getattr(cfg, given[0])} must be positive")
    batch = cfg.diff.batch
    _require(cfg.auto_warmup_steps > 0 and cfg.auto_warmup_steps % batch == 0,
             f"checkpoint.auto_warmup_steps={cfg.auto_warmup_steps} must be a positive multiple of "
             f"checkpoint.diff.batch={batch} (the interval is chosen at a batch end)")
    _require(cfg.capture_steps >= 1, f"checkpoint.capture_steps={cfg.capture_steps} must be at least 1")
    lowest = auto_min_interval(cfg)
    _require(cfg.auto_max_interval >= lowest,
             f"checkpoint.auto_max_interval={cfg.auto_max_interval} is below the smallest interval auto can "
             f"take, {lowest} (auto_warmup_steps + capture_steps in whole diff batches)")


def _check_streams(cfg: CheckpointConfig) -> None:
    d = cfg.diff
    _check_interval(cfg)
    _require(d.compression in COMPRESSIONS,
             f"checkpoint.diff.compression={d.compression!r} must be one of {', '.join(COMPRESSIONS)}")
    _require(0.0 < d.topk_ratio <= 1.0, f"checkpoint.diff.topk_ratio={d.topk_ratio} must be in (0, 1]")
    _require(d.small_threshold >= 0, f"checkpoint.diff.small_threshold={d.small_threshold} must be >= 0")
    _require(d.threads >= 0, f"checkpoint.diff.threads={d.threads} must be >= 0 (0: the loop's whole thread team)")
    _require(cfg.peer.max_chunk_mib > 0, f"checkpoint.peer.max_chunk_mib={cfg.peer.max_chunk_mib} must be positive")
    _require(cfg.memory_budget_gib > 0, f"checkpoint.memory_budget_gib={cfg.memory_budget_gib} must be positive")
    _require(cfg.base_capture in BASE_CAPTURES,
             f"checkpoint.base_capture={cfg.base_capture!r} must be one of {', '.join(BASE_CAPTURES)}")
    _require(cfg.capture_schedule in CAPTURE_SCHEDULES,
             f"checkpoint.capture_schedule={cfg.capture_schedule!r} must be one of {', '.join(CAPTURE_SCHEDULES)}")


def _nearest_existing(path: str) -> str:
    path = os.path.abspath(os.path.expanduser(path))
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def _check_local_root(root: str) -> None:
    _require(bool(root), "checkpoint.local.root is empty; set it to a RAM-backed directory such as /dev/shm/megatier")
    existing = _nearest_existing(root)
    fix = "point local.root at a writable RAM-backed directory (a tmpfs mount such as /dev/shm)"
    _require(os.path.isdir(existing) and os.access(existing, os.W_OK | os.X_OK),
             f"checkpoint.local.root={root!r}: {existing} is not a writable directory; {fix}")
    try:  # permissions can pass where files still cannot be made (/proc, a read-only mount): try one
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".megatier-probe-"):
            pass
    except OSError as e:
        raise ConfigError(f"checkpoint.local.root={root!r}: cannot create a file in {existing} "
                          f"({e.strerror or e}); {fix}") from e


def check_remote_url(url: str, endpoint_url: Optional[str]) -> None:
    """Raise ConfigError unless ``url`` is a directory path, file:// or s3://bucket[/prefix]."""
    _require(bool(url), "checkpoint.remote.url is empty; set a directory path or s3://bucket/prefix")
    parsed = urlparse(url)
    scheme = parsed.scheme
    # A Windows drive letter parses as a one-letter scheme; this project runs on POSIX only.
    _require(scheme in ("", "file", "s3"),
             f"checkpoint.remote.url={url!r}: scheme {scheme!r} is not supported; use a directory path, "
             f"file:///path or s3://bucket/prefix")
    if scheme == "s3":
        _require(bool(_BUCKET.match(parsed.netloc)),
                 f"checkpoint.remote.url={url!r}: {parsed.netloc!r} is not a valid S3 bucket name "
                 f"(3-63 lowercase letters, digits, dots or hyphens)")
    if endpoint_url is not None:
        _require(scheme == "s3", f"checkpoint.remote.endpoint_url={endpoint_url!r} is set but "
                                 f"checkpoint.remote.url={url!r} is not s3://; drop endpoint_url or use an s3:// url")
        ep = urlparse(endpoint_url)
        _require(ep.scheme in ("http", "https") and bool(ep.netloc),
                 f"checkpoint.remote.endpoint_url={endpoint_url!r} must look like http://host:port or https://host")


def _check_allow_changes(keys: list[str]) -> None:
    from megatier.config.fingerprint import fingerprint_keys

    known = fingerprint_keys()
    for key in keys:
        _require(key == "*" or key in known,
                 f"checkpoint.allow_changes has {key!r}, which is not part of the config fingerprint; use keys such "
                 f"as optim.lr or train.seed (see megatier/config/fingerprint.py), or '*' for any change")


def _check_last_resort(cfg: CheckpointConfig) -> None:
    _require(cfg.last_resort in LAST_RESORTS,
             f"checkpoint.last_resort={cfg.last_resort!r} must be one of {', '.join(LAST_RESORTS)}")
    cf = cfg.checkfree
    _require(cf.init in CHECKFREE_INITS,
             f"checkpoint.checkfree.init={cf.init!r} must be one of {', '.join(CHECKFREE_INITS)}")
    _require(cf.lr_scale > 0, f"checkpoint.checkfree.lr_scale={cf.lr_scale} must be positive (1.0: unchanged)")


def check_checkpoint_config(cfg: CheckpointConfig) -> None:
    """Raise ConfigError naming the field and what to do unless ``cfg`` can work (disabled: always fine)."""
    if not cfg.enabled:
        return
    _require(bool(_JOB_ID.match(cfg.job_id or "")),
             f"checkpoint.job_id={cfg.job_id!r} is not a plain name; use letters, digits, '.', '_' or '-' "
             f"(at most 128, starting with a letter or digit)")
    _check_tiers(cfg)
    _check_streams(cfg)
    _check_allow_changes(cfg.allow_changes)
    _check_last_resort(cfg)
    if "local" in cfg.tiers:
        _check_local_root(cfg.local.root)
        _require(cfg.local.keep_bases >= 1, f"checkpoint.local.keep_bases={cfg.local.keep_bases} must be >= 1; "
                                            f"the newest recovery point needs its base")
        _require(cfg.local.budget_gib >= 0, f"checkpoint.local.budget_gib={cfg.local.budget_gib} must be >= 0 "
                                            f"(0: no limit)")
    if "remote" in cfg.tiers:
        check_remote_url(cfg.remote.url, cfg.remote.endpoint_url)
        _require(cfg.remote.lease_s >= 1, f"checkpoint.remote.lease_s={cfg.remote.lease_s} must be >= 1")
        _require(cfg.remote.drain_timeout_s > 0,
                 f"checkpoint.remote.drain_timeout_s={cfg.remote.drain_timeout_s} must be positive")
        _require(cfg.remote.keep_bases >= 1, f"checkpoint.remote.keep_bases={cfg.remote.keep_bases} must be >= 1; "
                                             f"the recovery point needs at least one base")
        every = cfg.remote.base_every
        _require(isinstance(every, int) and not isinstance(every, bool) and every >= 1,
                 f"checkpoint.remote.base_every={every!r} must be an integer >= 1 (1: every base goes to Tier-3, "
                 f"n: every n-th base from the anchor)")
        _require(every == 1 or "local" in cfg.tiers,
                 f"checkpoint.remote.base_every={every} needs the local tier: without node memory the bases Tier-3 "
                 f"skips are kept nowhere; add local to checkpoint.tiers, or raise checkpoint.base_interval instead")


def effective_checkpoint_config(cfg: CheckpointConfig, num_nodes: int) -> CheckpointConfig:
    """``cfg`` as it can take effect on a job of ``num_nodes`` nodes, warning about each change."""
    if num_nodes < 1:
        raise ValueError(f"num_nodes={num_nodes} must be >= 1")
    if not cfg.enabled or "peer" not in cfg.tiers or num_nodes >= 2:
        return cfg
    warnings.warn("checkpoint.tiers includes peer but the job has 1 node; a same-node replica survives "
                  "nothing Tier-1 does not, so the peer tier is skipped", CheckpointConfigWarning, stacklevel=2)
    return dataclasses.replace(cfg, tiers=[t for t in cfg.tiers if t != "peer"])
