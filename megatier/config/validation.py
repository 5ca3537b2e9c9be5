"""Cross-field checks of the config, run before any side effect.

``validate`` raises :class:`ConfigError` with a one-line reason naming the
fields and a fix; it covers every group but ``checkpoint``, whose rules live
with the checkpoint code (:mod:`megatier.checkpoint.policy.rules`, which the
config layer may not import) and run right after it. Together they reject a
bad config before it creates a process group, a dataset or a wandb run.
"""
from __future__ import annotations

import math
import os
import warnings
from typing import Optional

from megatier.config.fast_path_validation import check_fast_path_config
from megatier.config.schema import (
    ARCHS,
    COMPILE_BACKENDS,
    LR_DECAY_STYLES,
    RECOMPUTE,
    ROUTER_LOSS_SCOPES,
    ROUTER_NORMS,
    WSD_DECAY_STYLES,
    Config,
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RecoveryConfig,
    ReliabilityConfig,
    TrainConfig,
    expert_ffn_size,
    ffn_size,
)
from megatier.config.schema import require as _require
from megatier.data.megatron_indexed import index_format
from megatier.data.megatron_splits import parse_blend, parse_split


class ConfigWarning(UserWarning):
    """A setting that is valid but has no effect here (the run goes on; the line says why and what to change)."""


def _validate_arch(m: ModelConfig, tp: int) -> None:
    _require(m.arch in ARCHS, f"model.arch={m.arch!r} must be one of {', '.join(ARCHS)}")
    _require(m.recompute in RECOMPUTE, f"model.recompute={m.recompute!r} must be one of {', '.join(RECOMPUTE)}")
    _require(m.compile_backend in COMPILE_BACKENDS, f"model.compile_backend={m.compile_backend!r} must be one of "
                                                    f"{', '.join(COMPILE_BACKENDS)}")
    if m.arch != "llama":
        _require(m.num_query_groups is None, f"model.num_query_groups={m.num_query_groups} is for model.arch=llama "
                                             f"(grouped-query attention); unset it for {m.arch}")
        _require(not m.qkv_bias, f"model.qkv_bias=true is for model.arch=llama ({m.arch}'s fused qkv projection "
                                 f"always has a bias); set model.qkv_bias=false")
        return
    _require(not m.qkv_bias or m.impl == "native", "model.qkv_bias=true: the Transformer Engine Llama block has "
                                                   "no biases; set model.impl=native or model.qkv_bias=false")
    groups = m.num_query_groups or m.num_heads
    _require(groups > 0 and m.num_heads % groups == 0, f"model.num_query_groups={groups} must divide "
                                                       f"model.num_heads={m.num_heads}")
    _require(groups % tp == 0, f"parallel.tp={tp} does not divide model.num_query_groups={groups} (the key/value "
                               f"heads); use a tp that divides them")
    _require((m.hidden_size // m.num_heads) % 2 == 0, f"model.hidden_size / model.num_heads = "
                                                      f"{m.hidden_size // m.num_heads} must be even for rotary "
                                                      f"positions")
    _require(m.rope_theta > 0, f"model.rope_theta={m.rope_theta} must be positive")
    _require(m.layernorm_impl == "native", f"model.layernorm_impl={m.layernorm_impl!r} is a LayerNorm; llama's "
                                           f"RMSNorm has model.layernorm_impl=native")


def _validate_expert_parallel(ep: int, num_experts: int, dp: Optional[int]) -> None:
    _require(ep >= 1, f"parallel.ep={ep} must be >= 1 (1: every rank holds every expert)")
    if ep == 1:
        return
    _require(num_experts > 0, f"parallel.ep={ep} splits routed experts, but the model has none; set "
                              f"parallel.ep=1 or model.moe.num_experts > 0")
    _require(num_experts % ep == 0, f"parallel.ep={ep} does not divide model.moe.num_experts={num_experts}; use an "
                                    f"ep that divides the expert count")
    _require(dp is None or dp % ep == 0, f"parallel.ep={ep} does not divide the data-parallel degree {dp} (world "
                                         f"size / parallel.tp / parallel.pp); use an ep that divides it or launch "
                                         f"more processes")


def _validate_moe(m: ModelConfig, tp: int, pp: int) -> None:
    e = m.moe
    _require(e.num_experts >= 0, f"model.moe.num_experts={e.num_experts} must be >= 0 (0: a dense model)")
    if e.num_experts == 0:
        return
    _require(m.arch == "llama", f"model.moe.num_experts={e.num_experts}: experts are SwiGLU MLPs of the Llama "
                                f"block; set model.arch=llama or model.moe.num_experts=0")
    _require(m.impl == "native", "model.moe runs on the native blocks; set model.impl=native")
    _require(1 <= e.top_k <= e.num_experts, f"model.moe.top_k={e.top_k} must be in [1, model.moe.num_experts="
                                            f"{e.num_experts}]")
    _require(e.router_norm in ROUTER_NORMS, f"model.moe.router_norm={e.router_norm!r} must be one of "
                                            f"{', '.join(ROUTER_NORMS)}")
    _require(e.layer_freq >= 1, f"model.moe.layer_freq={e.layer_freq} must be >= 1 (1: every layer)")
    for key in ("aux_loss_coeff", "z_loss_coeff", "shared_expert_hidden_size"):
        _require(getattr(e, key) >= 0, f"model.moe.{key}={getattr(e, key)} must be >= 0")
    _require(e.moe_ffn_hidden_size is None or e.moe_ffn_hidden_size > 0,
             f"model.moe.moe_ffn_hidden_size={e.moe_ffn_hidden_size} must be positive (or unset: the dense size)")
    for key, size in (("moe_ffn_hidden_size", expert_ffn_size(m)), ("shared_expert_hidden_size",
                                                                   e.shared_expert_hidden_size)):
        _require(size % tp == 0, f"parallel.tp={tp} does not divide model.moe.{key}={size} (each expert is cut "
                                 f"across tp like the dense MLP); change it or parallel.tp")
    _require(e.router_loss_scope in ROUTER_LOSS_SCOPES, f"model.moe.router_loss_scope={e.router_loss_scope!r} "
                                                        f"must be one of {', '.join(ROUTER_LOSS_SCOPES)}")
    _require(pp == 1 or e.router_loss_scope == "layer",
             f"model.moe.router_loss_scope={e.router_loss_scope!r} takes the router losses over every MoE layer "
             f"together, which pipeline stages (parallel.pp={pp}) hold apart; set model.moe.router_loss_scope=layer "
             f"(Megatron-core's per-layer losses) or parallel.pp=1")
    router_losses = e.aux_loss_coeff > 0 or e.z_loss_coeff > 0
    _require(pp == 1 or not router_losses or m.pipeline_order != "checkfree_plus",
             "model.moe's router losses are added where a stage's layers run, which model.pipeline_order="
             "checkfree_plus swaps; set model.pipeline_order=standard or model.moe.aux_loss_coeff and "
             "z_loss_coeff to 0")


def _validate_model(m: ModelConfig, tp: int, pp: int) -> None:
    for key in ("num_layers", "hidden_size", "num_heads", "max_position_embeddings", "make_vocab_size_divisible_by"):
        value = getattr(m, key)
        _require(value > 0, f"model.{key}={value} must be positive")
    _require(
        m.hidden_size % m.num_heads == 0,
        f"model.num_heads={m.num_heads} does not divide model.hidden_size={m.hidden_size}; "
        f"choose a head count that divides it",
    )
    _require(m.ffn_hidden_size is None or m.ffn_hidden_size > 0, f"model.ffn_hidden_size={m.ffn_hidden_size} must be "
                                                                 "positive")
    for key in ("hidden_dropout", "attention_dropout"):
        value = getattr(m, key)
        _require(0.0 <= value < 1.0, f"model.{key}={value} must be in [0, 1)")
    _require(
        m.num_heads % tp == 0,
        f"parallel.tp={tp} does not divide model.num_heads={m.num_heads}; use a tp that divides the head count",
    )
    ffn = ffn_size(m)
    _require(ffn % tp == 0, f"parallel.tp={tp} does not divide the FFN size {ffn}; change model.ffn_hidden_size or "
                            "parallel.tp")
    _validate_arch(m, tp)
    _validate_moe(m, tp, pp)
    _require(
        m.num_layers >= pp,
        f"parallel.pp={pp} exceeds model.num_layers={m.num_layers}; each pipeline stage needs at least one layer",
    )
    fmt, _, job_path = (m.init_from or "").partition(":")
    if fmt in ("torchtitan", "torch_dist", "megatron_legacy"):  # a whole job: megatier.training.job_import
        _require(os.path.isdir(os.path.expanduser(job_path)),
                 f"model.init_from={m.init_from!r}: {job_path} is not a directory; give the {fmt} checkpoint's "
                 f"directory after '{fmt}:'")
    elif m.init_from is not None:
        config_json = os.path.join(os.path.expanduser(m.init_from), "config.json")
        _require(os.path.isfile(config_json),
                 f"model.init_from={m.init_from!r}: {config_json} does not exist; give a Hugging Face GPT-2 or "
                 f"Llama (or Mixtral, Qwen2, Qwen2-MoE) directory (save_pretrained or megatier-convert export), a "
                 f"job as torchtitan:<dir>, torch_dist:<dir> or megatron_legacy:<dir>, or unset model.init_from")


def _validate_train(t: TrainConfig, dp: Optional[int]) -> None:
    for key in ("iters", "global_batch_size", "micro_batch_size", "eval_interval"):
        value = getattr(t, key)
        _require(value > 0, f"train.{key}={value} must be positive")
    _require(t.eval_iters >= 0, f"train.eval_iters={t.eval_iters} must be >= 0")
    _require(t.precision in ("fp32", "bf16", "fp16", "fp8"),
             f"train.precision={t.precision!r} must be one of fp32, bf16, fp16, fp8")
    _require(t.device in ("auto", "cpu", "cuda"), f"train.device={t.device!r} must be one of auto, cpu, cuda")
    per_step = t.micro_batch_size * (dp or 1)
    _require(
        t.global_batch_size % per_step == 0,
        f"train.global_batch_size={t.global_batch_size} is not a multiple of "
        f"train.micro_batch_size={t.micro_batch_size}"
        f" x dp={dp or 1}; make it a multiple of {per_step}",
    )
    if t.rampup_batch_size is not None:
        _validate_rampup(t, per_step)
    _require(t.exit_interval is None or t.exit_interval > 0,
             f"train.exit_interval={t.exit_interval} must be positive (or unset: no stop by step count)")
    _require(t.exit_duration_in_mins is None or t.exit_duration_in_mins > 0,
             f"train.exit_duration_in_mins={t.exit_duration_in_mins} must be positive (or unset: no time limit)")
    _require(t.log_interval > 0, f"train.log_interval={t.log_interval} must be positive (1: log every step)")


def _validate_rampup(t: TrainConfig, per_step: int) -> None:
    """Megatron's --rampup-batch-size checks, and every batch of the ramp whole micro-batches on each dp rank."""
    r = t.rampup_batch_size
    _require(len(r) == 3 and all(isinstance(v, int) and v > 0 for v in r),
             f"train.rampup_batch_size={list(r)} must be three positive integers [start, increment, samples]")
    start, increment, _ = r
    _require(start < t.global_batch_size and (t.global_batch_size - start) % increment == 0,
             f"train.rampup_batch_size={list(r)} must start below train.global_batch_size={t.global_batch_size} and "
             f"reach it in whole increments of {increment}")
    _require(start % per_step == 0 and increment % per_step == 0,
             f"train.rampup_batch_size={list(r)}: its start and increment must be multiples of "
             f"train.micro_batch_size x dp={per_step}")


def _validate_reliability(r: ReliabilityConfig, precision: str, o: OptimConfig) -> None:
    _require(r.on_nonfinite in ("stop", "skip_step"), f"reliability.on_nonfinite={r.on_nonfinite!r} must be stop or "
                                                     f"skip_step")
    backoff = o.hysteresis * max(0, math.ceil(math.log2(o.initial_loss_scale / o.min_loss_scale)))
    _require(precision != "fp16" or r.max_consecutive_skips >= backoff,
             f"reliability.max_consecutive_skips={r.max_consecutive_skips} would stop an fp16 run before its loss "
             f"scale can back off from optim.initial_loss_scale to optim.min_loss_scale ({backoff} skipped steps); "
             f"raise it to at least {backoff}")
    _require(r.spike_factor == 0 or r.spike_factor > 1, f"reliability.spike_factor={r.spike_factor} must be 0 (off) "
                                                         f"or above 1")
    _require(r.max_consecutive_skips >= 1, f"reliability.max_consecutive_skips={r.max_consecutive_skips} must be "
                                           f">= 1")
    _require(r.loop_window >= 0, f"reliability.loop_window={r.loop_window} must be >= 0 (steps after a restore)")
    _require(r.loop_limit >= 0, f"reliability.loop_limit={r.loop_limit} must be >= 0 (0 turns the guard off)")
    _require(r.replica_check_interval >= 0, f"reliability.replica_check_interval={r.replica_check_interval} must be "
                                             f">= 0 (0 turns the check off)")


def _validate_optim(o: OptimConfig) -> None:
    _require(o.lr > 0, f"optim.lr={o.lr} must be positive")
    _require(0 <= o.min_lr <= o.lr, f"optim.min_lr={o.min_lr} must be in [0, optim.lr={o.lr}]")
    _require(o.warmup_iters >= 0, f"optim.warmup_iters={o.warmup_iters} must be >= 0")
    _require(o.decay_iters is None or o.decay_iters > 0, f"optim.decay_iters={o.decay_iters} must be positive")
    _validate_schedule(o)
    for key in ("beta1", "beta2"):
        value = getattr(o, key)
        _require(0.0 <= value < 1.0, f"optim.{key}={value} must be in [0, 1)")
    _require(o.eps > 0, f"optim.eps={o.eps} must be positive")
    _require(o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay} must be >= 0")
    _require(o.clip_grad >= 0, f"optim.clip_grad={o.clip_grad} must be >= 0 (0 disables clipping)")
    _require(o.initial_loss_scale >= o.min_loss_scale > 0, "optim.initial_loss_scale must be >= optim.min_loss_scale "
                                                           "> 0")


def _validate_schedule(o: OptimConfig) -> None:
    """The decay style and its settings, as Megatron's --lr-* flags allow them."""
    _require(o.decay_style in LR_DECAY_STYLES,
             f"optim.decay_style={o.decay_style!r} must be one of {', '.join(LR_DECAY_STYLES)}")
    _require(o.wsd_decay_style in WSD_DECAY_STYLES,
             f"optim.wsd_decay_style={o.wsd_decay_style!r} must be one of {', '.join(WSD_DECAY_STYLES)}")
    _require(o.decay_style != "wsd" or o.wsd_decay_iters is not None,
             "optim.decay_style=wsd needs optim.wsd_decay_iters, the steps of its final decay")
    _require(o.wsd_decay_iters is None or 0 < o.wsd_decay_iters <= (o.decay_iters or o.wsd_decay_iters),
             f"optim.wsd_decay_iters={o.wsd_decay_iters} must be in [1, optim.decay_iters={o.decay_iters}]")
    _require(0 <= o.warmup_init_lr <= o.lr, f"optim.warmup_init_lr={o.warmup_init_lr} must be in [0, optim.lr={o.lr}]")
    if o.warmup_fraction is not None:
        _require(0 <= o.warmup_fraction < 1, f"optim.warmup_fraction={o.warmup_fraction} must be in [0, 1)")
        _require(o.warmup_iters == 0, f"optim.warmup_fraction and optim.warmup_iters={o.warmup_iters} both set the "
                                      f"warmup; set optim.warmup_iters=0")


def _validate_recovery(r: RecoveryConfig) -> None:
    _require(r.mode in ("inprocess", "relaunch"), f"recovery.mode={r.mode!r} must be inprocess or relaunch")
    if r.store is not None:
        host, _, port = str(r.store).rpartition(":")
        _require(bool(host) and port.isdigit(), f"recovery.store={r.store!r} must be host:port (where "
                                                "`megatier-agent --serve-store` listens)")
    _require(r.wait_for_replacement_s >= 0, f"recovery.wait_for_replacement_s={r.wait_for_replacement_s} must be "
                                            f">= 0")
    _require(r.round_timeout_s > 0, f"recovery.round_timeout_s={r.round_timeout_s} must be positive")


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
        stem, named = os.path.splitext(d.prefix)
        for suffix in (".bin", ".idx"):
            path = os.path.expanduser(d.prefix) + suffix
            _require(os.path.isfile(path) or named not in (".bin", ".idx"),
                     f"data.prefix={d.prefix!r} names one of the dataset's files; data.prefix is their path without "
                     f".bin or .idx: data.prefix={stem}")
            _require(
                os.path.isfile(path),
                f"data.prefix={d.prefix!r}: {path} does not exist; build it with megatier-preprocess "
                f"--output-prefix {d.prefix} or leave data.prefix unset for the default corpus",
            )
        _validate_blend("data.prefix", [d.prefix], m)


def _validate_blends(d: DataConfig, m: ModelConfig) -> None:
    """Megatron's blends and splits (docs/data.md): one way to name the data, well-formed lists, corpora that
    exist, and a vocabulary for Megatron corpora, which record none."""
    per_split = {"data.train_blend": d.train_blend, "data.valid_blend": d.valid_blend, "data.test_blend": d.test_blend}
    given = [key for key, value in per_split.items() if value is not None]
    _require(d.split is None or d.blend is not None, f"data.split={d.split!r} cuts the corpora of data.blend; set "
                                                      f"data.blend (Megatron's --data-path) or unset data.split")
    if d.blend is None and not given:
        _require(d.train_samples is None, "data.train_samples sizes a blend's order; set data.blend (or "
                                          "data.train_blend) or unset data.train_samples")
        return
    named = "data.blend" if d.blend is not None else given[0]
    _require(d.prefix is None, f"data.prefix and {named} both name the data; keep one (unset data.prefix)")
    _require(d.blend is None or not given, f"data.blend and {given[0] if given else ''} both name the data, as "
                                           f"Megatron's --data-path and --train-data-path do; keep one")
    _require(d.blend is not None or d.train_blend is not None,
             f"{named} without data.train_blend leaves nothing to train on; set data.train_blend too")
    _require(d.mid_level_dataset_surplus >= 0, f"data.mid_level_dataset_surplus={d.mid_level_dataset_surplus} "
                                                f"must be >= 0")
    if d.split is not None:
        try:
            parse_split(d.split)
        except ValueError as e:
            raise ConfigError(f"data.split: {e}") from None
    blends = {"data.blend": d.blend, **per_split}
    for key, blend in blends.items():
        if blend is not None:
            _validate_blend(key, blend, m)


def _validate_train_samples(d: DataConfig, t) -> None:
    needed = t.iters * t.global_batch_size
    _require(d.train_samples is None or d.train_samples >= needed,
             f"data.train_samples={d.train_samples} is fewer than the {needed} samples train.iters={t.iters} x "
             f"train.global_batch_size={t.global_batch_size} trains on; raise it to at least {needed}, or unset it")


def _validate_blend(key: str, blend: list, m: ModelConfig) -> None:
    try:
        prefixes, _ = parse_blend(blend)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None
    for prefix in prefixes:
        for suffix in (".bin", ".idx"):
            path = os.path.expanduser(prefix) + suffix
            _require(os.path.isfile(path), f"{key}: {path} does not exist; name each corpus by its path without "
                                           f".bin or .idx")
        try:
            kind = index_format(os.path.expanduser(prefix) + ".idx")
        except ValueError as e:
            raise ConfigError(f"{key}: {e}") from None
        _require(kind != "megatron" or m.vocab_size is not None,
                 f"{key}: {prefix} is a Megatron corpus, which records no vocabulary; set model.vocab_size to its "
                 f"tokenizer's (Megatron's --vocab-size, or the tokenizer's size)")


def _validate_pipeline_order(m: ModelConfig, t: TrainConfig, pp: int, dp: Optional[int]) -> None:
    _require(m.pipeline_order in ("standard", "checkfree_plus"),
             f"model.pipeline_order={m.pipeline_order!r} must be standard or checkfree_plus")
    if m.pipeline_order != "checkfree_plus":
        return
    _require(pp >= 4, f"model.pipeline_order=checkfree_plus swaps stages 0/1 and the last two, which needs "
                      f"parallel.pp >= 4 (got {pp}); use pipeline_order=standard")
    _require(m.num_layers % pp == 0, f"model.pipeline_order=checkfree_plus needs stages of identical shape: "
                                     f"model.num_layers={m.num_layers} must be divisible by parallel.pp={pp}")
    n = (t.rampup_batch_size or [t.global_batch_size])[0] // (t.micro_batch_size * (dp or 1))  # the smallest batch
    _require(dp is None or n >= 2, f"model.pipeline_order=checkfree_plus swaps every second micro-batch, but each "
                                   f"rank gets {n}; raise train.global_batch_size (or the ramp's start in "
                                   f"train.rampup_batch_size) or lower train.micro_batch_size")


def check_interleaving(*, pp: int, virtual_stages: int, num_microbatches: int, num_layers: int) -> None:
    """The conditions interleaving needs, each failure one line naming the field and the fix."""
    if virtual_stages < 1:
        raise ConfigError(f"parallel.virtual_stages={virtual_stages}: set it to 1 (off) or more")
    if virtual_stages == 1:
        return
    if pp < 2:
        raise ConfigError(f"parallel.virtual_stages={virtual_stages} needs parallel.pp >= 2: "
                          "set parallel.virtual_stages=1 or raise parallel.pp")
    if num_microbatches % pp:
        raise ConfigError(f"micro-batches per step ({num_microbatches}) must be a multiple of parallel.pp={pp} "
                          "with parallel.virtual_stages > 1: change train.global_batch_size")
    if num_layers % (pp * virtual_stages):
        raise ConfigError(f"model.num_layers={num_layers} must be a multiple of parallel.pp x "
                          f"parallel.virtual_stages={pp * virtual_stages}: change either")


def _validate_interleaving(cfg: Config, dp: Optional[int]) -> None:
    """parallel.virtual_stages (megatier.parallel.interleaved): its layout conditions, on every batch size of the
    ramp once the world size gives the micro-batch count; CheckFree+'s routes do not know model chunks (CheckFree
    itself rebuilds a lost stage chunk by chunk, megatier.checkpoint.recover.checkfree)."""
    p, t = cfg.parallel, cfg.train
    start, increment = (t.rampup_batch_size or [t.global_batch_size, 1])[:2]
    batches = range(start, t.global_batch_size + 1, increment) if dp and increment > 0 else [0]
    for batch in batches:
        n = batch // (t.micro_batch_size * dp) if dp else p.pp  # unknown before the world size: assume it fits
        check_interleaving(pp=p.pp, virtual_stages=p.virtual_stages, num_microbatches=n,
                           num_layers=cfg.model.num_layers)
    _require(p.virtual_stages == 1 or cfg.model.pipeline_order == "standard",
             "parallel.virtual_stages > 1 runs model chunks that CheckFree+'s routes do not know; set "
             "model.pipeline_order=standard or parallel.virtual_stages=1")


def _validate_overlap(p: ParallelConfig, m: ModelConfig) -> None:
    """parallel.overlap_grad_reduce, overlap_param_gather and bucket_mb (megatier.optim.overlap)."""
    _require(p.bucket_mb >= 0, f"parallel.bucket_mb={p.bucket_mb} must be >= 0 (MiB of fp32 gradient per bucket; "
                               f"0: the default size)")
    _require(not (p.overlap_param_gather and m.compile),
             "parallel.overlap_param_gather waits for parameters in forward pre-hooks, which would break "
             "model.compile's graphs; set model.compile=false or parallel.overlap_param_gather=false")
    _require(not (p.overlap_grad_reduce and m.pipeline_order == "checkfree_plus"),
             "parallel.overlap_grad_reduce counts one backward per micro-batch, which CheckFree+'s routes do not "
             "keep to; set parallel.overlap_grad_reduce=false or model.pipeline_order=standard")


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
        dp = p.dp(world_size)
    _validate_expert_parallel(p.ep, cfg.model.moe.num_experts, dp)
    _validate_overlap(p, cfg.model)
    _validate_model(cfg.model, p.tp, p.pp)
    _validate_train(cfg.train, dp)
    _validate_interleaving(cfg, dp)  # after the ramp's own checks: it walks the ramp
    _validate_pipeline_order(cfg.model, cfg.train, p.pp, dp)
    _validate_optim(cfg.optim)
    _validate_data(cfg.data, cfg.model)
    _validate_blends(cfg.data, cfg.model)
    _validate_train_samples(cfg.data, cfg.train)
    if p.sequence_parallel and p.tp == 1:
        warnings.warn("parallel.sequence_parallel=true does nothing at parallel.tp=1: it cuts activations across the "
                      "tensor-parallel ranks; set parallel.tp > 1, or leave it unset", ConfigWarning, stacklevel=2)
    if p.sequence_parallel and p.tp > 1:
        _require(cfg.data.seq_len % p.tp == 0, f"parallel.sequence_parallel cuts the sequence across tp: "
                                               f"data.seq_len={cfg.data.seq_len} must be a multiple of "
                                               f"parallel.tp={p.tp}")
        _require(cfg.model.impl == "native", f"parallel.sequence_parallel runs on the native blocks; "
                                             f"model.impl={cfg.model.impl} has its own (set model.impl=native)")
    _validate_reliability(cfg.reliability, cfg.train.precision, cfg.optim)
    _validate_recovery(cfg.recovery)
    w = cfg.logging.wandb
    _require(w.mode in ("offline", "online", "disabled"), f"logging.wandb.mode={w.mode!r} must be offline, online or "
                                                          "disabled")
    _validate_sinks_and_eval(cfg)
    check_fast_path_config(cfg, p.tp)


def _validate_sinks_and_eval(cfg: Config) -> None:
    """logging.tensorboard needs its package (imported only when enabled); train.eval_only needs checkpoints."""
    if cfg.logging.tensorboard:
        import importlib.util

        _require(importlib.util.find_spec("tensorboard") is not None,
                 "logging.tensorboard=true needs the tensorboard package, which is not installed; install it "
                 "(pip install 'megatier[tensorboard]', or pip install tensorboard) or set logging.tensorboard=false")
    _require(not cfg.train.eval_only or cfg.checkpoint.enabled,
             "train.eval_only=true evaluates the job's checkpoint, but checkpointing is off (checkpoint=disabled); "
             "launch it with the checkpoint settings the job trained with (e.g. checkpoint=tiered)")
