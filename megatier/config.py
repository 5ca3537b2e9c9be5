"""Typed configuration schemas, registered in Hydra's ConfigStore.

Every component receives only its own sub-config (a dataclass below), never the
root. ``validate`` runs the cross-field checks before any work starts and
raises :class:`ConfigError` with a one-line reason naming the fields and a fix.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the fields and a fix."""


@dataclass
class ModelConfig:
    """GPT-2 shape. ``ffn_hidden_size`` defaults to 4 * hidden_size."""

    name: str = "tiny"
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    ffn_hidden_size: Optional[int] = None
    max_position_embeddings: int = 128
    # None: taken from the dataset's tokenizer, then padded (see padded_vocab_size).
    vocab_size: Optional[int] = None
    make_vocab_size_divisible_by: int = 128
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    layernorm_eps: float = 1e-5
    init_std: float = 0.02


@dataclass
class ParallelConfig:
    """Parallel layout. dp is derived: world_size / (tp * pp)."""

    tp: int = 1
    pp: int = 1
    # Seconds any collective may take before the run fails instead of hanging.
    timeout_s: float = 600.0


@dataclass
class OptimConfig:
    """AdamW with warmup + cosine decay, global-norm clipping and a dynamic loss scaler."""

    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_iters: int = 10
    # None: decay over the whole run (train.iters).
    decay_iters: Optional[int] = None
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    # 0 disables clipping.
    clip_grad: float = 1.0
    # fp16 dynamic loss scaling (ignored for fp32/bf16).
    initial_loss_scale: float = 65536.0
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2


@dataclass
class DataConfig:
    """Token dataset. ``prefix`` names ``<prefix>.bin`` / ``<prefix>.idx`` from scripts/preprocess_data.py."""

    # None: the default corpus (Python's standard library source), built on first use in cache_dir.
    prefix: Optional[str] = None
    # None: $MEGATIER_CACHE, else ~/.cache/megatier.
    cache_dir: Optional[str] = None
    # Tokenizer for the default corpus only: byte | bpe.
    tokenizer: str = "byte"
    bpe_vocab_size: int = 4096
    default_corpus_mib: float = 8.0
    seq_len: int = 128
    val_fraction: float = 0.05
    seed: int = 1234


@dataclass
class TrainConfig:
    """Loop settings. global_batch_size = micro_batch_size * dp * micro-batches per step."""

    iters: int = 100
    global_batch_size: int = 8
    micro_batch_size: int = 4
    seed: int = 1234
    precision: str = "fp32"  # fp32 | bf16 | fp16
    device: str = "auto"  # auto | cpu | cuda
    eval_interval: int = 50
    eval_iters: int = 2
    # None: leave torch's default.
    threads: Optional[int] = None


@dataclass
class DiffStreamConfig:
    """Differential stream: every step's gradient shard, compressed, saved N steps per batch."""

    # N consecutive steps per diff batch, the unit of saving and replay.
    batch: int = 5
    compression: str = "adaptive"  # adaptive | int8 | topk | bf16 | fp32 (fp32 replays bit for bit)
    topk_ratio: float = 0.01
    # adaptive: segments with fewer elements than this use blockwise INT8, larger ones top-k.
    small_threshold: int = 100_000


@dataclass
class PeerTierConfig:
    """Tier-2: replication to the same local rank on the next node of the ring."""

    # Cap on one paced chunk of a base replica.
    max_chunk_mib: float = 256.0


@dataclass
class LocalTierConfig:
    """Tier-1: node memory that outlives the process; files under <root>/<job_id>/<node>/."""

    root: str = "/dev/shm/megatier"


@dataclass
class RemoteTierConfig:
    """Tier-3: a directory (a shared file system) or s3://bucket/prefix; objects under <url>/<job_id>/."""

    url: str = "checkpoints"
    # S3-compatible endpoint (MinIO, moto, ...); None: AWS. Credentials come from the usual AWS environment.
    endpoint_url: Optional[str] = None
    # Committed bases kept on Tier-3 at or below the watermark.
    keep_bases: int = 2
    # Directory remotes: fsync each object before it becomes visible (durable through a power loss of the
    # machine that wrote it). False for a file system that is durable on close (NFS, Lustre) or to match
    # baselines that do not fsync either; S3 ignores it.
    fsync: bool = True


@dataclass
class CheckpointConfig:
    """Tiered checkpointing (see DESIGN.md section 4); checked by megatier.checkpoint.validation."""

    enabled: bool = False
    tiers: list[str] = field(default_factory=lambda: ["local", "peer", "remote"])
    # Steps between base checkpoints; must be a multiple of diff.batch.
    base_interval: int = 50
    diff: DiffStreamConfig = field(default_factory=DiffStreamConfig)
    peer: PeerTierConfig = field(default_factory=PeerTierConfig)
    local: LocalTierConfig = field(default_factory=LocalTierConfig)
    remote: RemoteTierConfig = field(default_factory=RemoteTierConfig)
    # Names this run's checkpoints in every tier; a plain name ([A-Za-z0-9._-]).
    job_id: str = "${logging.name}"
    # Host memory that checkpoint payloads awaiting transfer may hold before the loop blocks.
    memory_budget_gib: float = 8.0
    # With traces of this job in some tier but no complete base for every rank, start from step 0
    # instead of stopping with an error (a first launch, with no traces at all, always starts fresh).
    allow_fresh_start: bool = False


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "megatier"
    # None: logging.name.
    name: Optional[str] = None
    tags: list[str] = field(default_factory=list)


@dataclass
class LoggingConfig:
    name: str = "megatier"
    run_dir: str = "runs/${logging.name}"
    progress: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def register_configs() -> None:
    """Register the schemas so YAML in configs/ is validated against them (struct mode)."""
    cs = ConfigStore.instance()
    cs.store(name="megatier_schema", node=Config)


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """A script's own arguments and the Hydra overrides after ``--`` (scripts that run pretrain_gpt jobs)."""
    if "--" not in argv:
        return list(argv), []
    i = argv.index("--")
    return list(argv[:i]), list(argv[i + 1:])


def compose_config(overrides: list[str], config_dir: Optional[str] = None) -> Config:
    """The Config ``pretrain_gpt.py <overrides>`` would run with, for scripts that drive or measure it."""
    from hydra import compose, initialize_config_dir

    register_configs()
    config_dir = config_dir or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="config", overrides=list(overrides)))


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _validate_model(m: ModelConfig, tp: int, pp: int) -> None:
    for key in ("num_layers", "hidden_size", "num_heads", "max_position_embeddings", "make_vocab_size_divisible_by"):
        value = getattr(m, key)
        _require(value > 0, f"model.{key}={value} must be positive")
    _require(
        m.hidden_size % m.num_heads == 0,
        f"model.num_heads={m.num_heads} does not divide model.hidden_size={m.hidden_size}; "
        f"choose a head count that divides it",
    )
    _require(m.ffn_hidden_size is None or m.ffn_hidden_size > 0, f"model.ffn_hidden_size={m.ffn_hidden_size} must be positive")
    for key in ("hidden_dropout", "attention_dropout"):
        value = getattr(m, key)
        _require(0.0 <= value < 1.0, f"model.{key}={value} must be in [0, 1)")
    _require(
        m.num_heads % tp == 0,
        f"parallel.tp={tp} does not divide model.num_heads={m.num_heads}; use a tp that divides the head count",
    )
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    _require(ffn % tp == 0, f"parallel.tp={tp} does not divide the FFN size {ffn}; change model.ffn_hidden_size or parallel.tp")
    _require(
        m.num_layers >= pp,
        f"parallel.pp={pp} exceeds model.num_layers={m.num_layers}; each pipeline stage needs at least one layer",
    )


def _validate_train(t: TrainConfig, dp: Optional[int]) -> None:
    for key in ("iters", "global_batch_size", "micro_batch_size", "eval_interval"):
        value = getattr(t, key)
        _require(value > 0, f"train.{key}={value} must be positive")
    _require(t.eval_iters >= 0, f"train.eval_iters={t.eval_iters} must be >= 0")
    _require(t.precision in ("fp32", "bf16", "fp16"), f"train.precision={t.precision!r} must be one of fp32, bf16, fp16")
    _require(t.device in ("auto", "cpu", "cuda"), f"train.device={t.device!r} must be one of auto, cpu, cuda")
    per_step = t.micro_batch_size * (dp or 1)
    _require(
        t.global_batch_size % per_step == 0,
        f"train.global_batch_size={t.global_batch_size} is not a multiple of train.micro_batch_size={t.micro_batch_size}"
        f" x dp={dp or 1}; make it a multiple of {per_step}",
    )


def _validate_optim(o: OptimConfig) -> None:
    _require(o.lr > 0, f"optim.lr={o.lr} must be positive")
    _require(0 <= o.min_lr <= o.lr, f"optim.min_lr={o.min_lr} must be in [0, optim.lr={o.lr}]")
    _require(o.warmup_iters >= 0, f"optim.warmup_iters={o.warmup_iters} must be >= 0")
    _require(o.decay_iters is None or o.decay_iters > 0, f"optim.decay_iters={o.decay_iters} must be positive")
    for key in ("beta1", "beta2"):
        value = getattr(o, key)
        _require(0.0 <= value < 1.0, f"optim.{key}={value} must be in [0, 1)")
    _require(o.eps > 0, f"optim.eps={o.eps} must be positive")
    _require(o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay} must be >= 0")
    _require(o.clip_grad >= 0, f"optim.clip_grad={o.clip_grad} must be >= 0 (0 disables clipping)")
    _require(o.initial_loss_scale >= o.min_loss_scale > 0, "optim.initial_loss_scale must be >= optim.min_loss_scale > 0")


def _validate_data(d: DataConfig, m: ModelConfig) -> None:
    _require(d.seq_len > 0, f"data.seq_len={d.seq_len} must be positive")
    _require(
        d.seq_len <= m.max_position_embeddings,
        f"data.seq_len={d.seq_len} exceeds model.max_position_embeddings={m.max_position_embeddings}; "
        f"lower data.seq_len or raise the position table",
    )
    _require(0.0 <= d.val_fraction < 1.0, f"data.val_fraction={d.val_fraction} must be in [0, 1)")
    _require(d.tokenizer in ("byte", "bpe"), f"data.tokenizer={d.tokenizer!r} must be byte or bpe")
    if d.prefix is not None:
        for suffix in (".bin", ".idx"):
            path = os.path.expanduser(d.prefix) + suffix
            _require(
                os.path.isfile(path),
                f"data.prefix={d.prefix!r}: {path} does not exist; build it with scripts/preprocess_data.py "
                f"--output-prefix {d.prefix} or leave data.prefix unset for the default corpus",
            )


def validate(cfg: Config, world_size: Optional[int] = None) -> None:
    """Cross-field checks; raises ConfigError with a one-line reason. ``world_size`` enables layout checks."""
    p = cfg.parallel
    _require(p.tp >= 1 and p.pp >= 1, f"parallel.tp={p.tp} and parallel.pp={p.pp} must be >= 1")
    _require(p.timeout_s > 0, f"parallel.timeout_s={p.timeout_s} must be positive")
    dp = None
    if world_size is not None:
        _require(
            world_size % (p.tp * p.pp) == 0,
            f"world size {world_size} is not divisible by parallel.tp={p.tp} x parallel.pp={p.pp}; "
            f"launch a multiple of {p.tp * p.pp} processes or change the layout",
        )
        dp = world_size // (p.tp * p.pp)
    _validate_model(cfg.model, p.tp, p.pp)
    _validate_train(cfg.train, dp)
    _validate_optim(cfg.optim)
    _validate_data(cfg.data, cfg.model)
    w = cfg.logging.wandb
    _require(w.mode in ("offline", "online", "disabled"), f"logging.wandb.mode={w.mode!r} must be offline, online or disabled")
