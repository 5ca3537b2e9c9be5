"""Typed configuration schemas: one dataclass per config group, registered in Hydra's ConfigStore.

Every component receives only its own sub-config (a dataclass below), never the
root.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union


class ConfigError(ValueError):
    """A configuration that cannot work; the message names the fields and a fix."""


def require(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless ``ok``."""
    if not ok:
        raise ConfigError(message)


ARCHS = ("gpt2", "llama")
RECOMPUTE = ("none", "selective", "full")
COMPILE_BACKENDS = ("inductor", "aot_eager")  # model.compile_backend
ROUTER_NORMS = ("topk_softmax", "softmax_topk")
ROUTER_LOSS_SCOPES = ("model", "layer")


@dataclass
class MoEConfig:
    """Mixture-of-experts blocks in the Llama family (``model.moe.*``; megatier.model.moe): the MLP of every
    ``layer_freq``-th layer replaced by ``num_experts`` SwiGLU experts, each token sent to its ``top_k`` (dropless:
    no capacity, no token dropped). ``num_experts=0``: dense."""

    num_experts: int = 0
    top_k: int = 2
    # Each expert's SwiGLU hidden size; None: model.ffn_hidden_size.
    moe_ffn_hidden_size: Optional[int] = None
    # How the router weighs a token's experts: "topk_softmax" (Mixtral: softmax over the top-k logits) or
    # "softmax_topk" (Qwen-MoE: the top-k of the softmax over all experts, renormalized to sum 1 when
    # router_renormalize, Qwen's norm_topk_prob).
    router_norm: str = "topk_softmax"
    router_renormalize: bool = False
    # The load-balancing loss (Switch/Mixtral: num_experts * sum over experts of the fraction of top-k slots it
    # got times its mean router probability, over the MoE layers' tokens together, as transformers' Mixtral)
    # times this is added to the loss; Mixtral's router_aux_loss_coef is 0.02 (0: not computed).
    aux_loss_coeff: float = 0.0
    # The router z-loss (ST-MoE: the mean squared logsumexp of the router logits) times this (0: not computed).
    z_loss_coeff: float = 0.0
    # Over which tokens the two router losses are taken: "model" (transformers' Mixtral and Qwen-MoE: the MoE
    # layers' tokens together, one loss each) or "layer" (Megatron-core's aux_loss: each MoE layer's own
    # load-balancing loss, with Megatron's 1/top_k, and its own z-loss, summed over the layers). Pipeline
    # stages (parallel.pp > 1) need "layer": each stage adds its own layers' losses to its backward.
    router_loss_scope: str = "model"
    # A shared expert every token goes through, weighed by a sigmoid gate (Qwen2-MoE); its SwiGLU hidden size,
    # 0: none.
    shared_expert_hidden_size: int = 0
    # MoE on layers 0, n, 2n, ... (Megatron's moe_layer_freq); the others keep the dense MLP.
    layer_freq: int = 1


@dataclass
class ModelConfig:
    """A decoder's shape. ``ffn_hidden_size`` defaults to 4 * hidden_size (gpt2) or to Llama's
    8/3 * hidden_size rounded up to a multiple of 256 (llama)."""

    name: str = "tiny"
    # The block: "gpt2" (learned positions, LayerNorm, GELU MLP, biases, head tied to the embedding) or "llama"
    # (rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention, no biases, an untied head).
    arch: str = "gpt2"
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    ffn_hidden_size: Optional[int] = None
    # llama: the key/value heads (grouped-query attention; None: one per query head); tp must divide them.
    num_query_groups: Optional[int] = None
    # llama: biases on the query, key and value projections (not on the output projection), as Qwen2 and
    # Qwen2-MoE have; the Hugging Face export is then a Qwen2 (megatier.interop.qwen2_moe). Native blocks only.
    qkv_bias: bool = False
    # llama: the base of the rotary position embedding's frequencies.
    rope_theta: float = 10000.0
    max_position_embeddings: int = 128
    # None: taken from the dataset's tokenizer, then padded (see padded_vocab_size).
    vocab_size: Optional[int] = None
    make_vocab_size_divisible_by: int = 128
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    norm_eps: float = 1e-5  # the LayerNorms' (gpt2) or RMSNorms' (llama) epsilon
    init_std: float = 0.02
    # A Hugging Face GPT-2, Llama, Mixtral, Qwen2 or Qwen2-MoE directory (config.json + model.safetensors) of this
    # shape to start from (fine-tuning): the weights replace the initialisation before the optimizer copies them;
    # Adam moments start at zero. Or a whole job to continue, as torchtitan:<dir>, torch_dist:<dir> or
    # megatron_legacy:<dir> (megatier.training.job_import: weights, moments, step, schedule, data position).
    init_from: Optional[str] = None
    # The same GPT-2 function computed by other libraries (docs/configuration.md, "GPU fast paths"; a relaunch may
    # switch them):
    # the blocks "native" (torch) or "te" (Transformer Engine's LayerNormLinear, Linear and LayerNormMLP, which
    # fuse the blocks' LayerNorms); the LayerNorms not fused (all with native, the final one with te) "native" or
    # "apex" (NVIDIA apex's FusedLayerNorm). Both need CUDA.
    impl: str = "native"
    layernorm_impl: str = "native"
    # The order micro-batches pass the pipeline stages: "standard", or "checkfree_plus" (the odd micro-batches
    # of each step with the layers of stages 0/1 and P-2/P-1 swapped, and replicas of the end stages' other
    # parameters on the neighbouring stages, so a lost first or last stage can be rebuilt;
    # megatier.parallel.checkfree_plus). Needs parallel.pp >= 4, num_layers divisible by pp, >= 2 micro-batches.
    pipeline_order: str = "standard"
    # Activation recomputation: "none"; "selective" (the attention core: its inputs are kept, its scores and
    # probabilities recomputed in the backward); "full" (each block keeps only its input). The dropout masks are
    # drawn again identically, so the gradients are those of "none".
    recompute: str = "none"
    # torch.compile of each transformer block (regional compilation: megatier.model.compile), in place, so names,
    # checkpoints and digests are an eager run's; a relaunch may switch it. Off by default: on the CPU it costs
    # compile time for little or no gain; turn it on for GPU runs, where it fuses the blocks' elementwise work.
    compile: bool = False
    # The compiler: "inductor" (generated kernels; fp32 results equal to eager's within rounding) or "aot_eager"
    # (traced, run as eager ops: bitwise an eager run, no speed-up; checks that the model compiles).
    compile_backend: str = "inductor"
    moe: MoEConfig = field(default_factory=MoEConfig)

    def __post_init__(self):
        if isinstance(self.moe, dict):  # ModelConfig(**preset) with the moe group as a mapping
            self.moe = MoEConfig(**self.moe)


def ffn_size(m: "ModelConfig") -> int:
    """The MLP's hidden size: ``ffn_hidden_size``, else GPT-2's 4 h, or Llama's 8/3 h rounded up to 256."""
    if m.ffn_hidden_size:
        return m.ffn_hidden_size
    if m.arch == "llama":
        return -(-(8 * m.hidden_size // 3) // 256) * 256
    return 4 * m.hidden_size


def is_moe_layer(m: "ModelConfig", layer: int) -> bool:
    """Whether global layer ``layer`` is a mixture of experts (model.moe.layer_freq)."""
    return m.moe.num_experts > 0 and layer % m.moe.layer_freq == 0


def expert_ffn_size(m: "ModelConfig") -> int:
    """An expert's SwiGLU hidden size: model.moe.moe_ffn_hidden_size, else the dense MLP's."""
    return m.moe.moe_ffn_hidden_size or ffn_size(m)


@dataclass
class ParallelConfig:
    """Parallel layout. dp is derived: world_size / (tp * pp)."""

    tp: int = 1
    pp: int = 1
    # Sequence parallelism (Megatron's): the norms, dropouts and residual adds run on sequence slices of each tp
    # rank; the column-parallel linears all-gather the sequence first and the row-parallel ones reduce-scatter
    # it after. The same loss and gradients, and tp times less activation memory outside the linears. No
    # effect at tp=1.
    sequence_parallel: bool = False
    # Expert parallelism: model.moe's routed experts split over this many ranks of each data-parallel group
    # (num_experts / ep experts each; tokens dispatched to their experts' ranks and back by all-to-all); must
    # divide the data-parallel degree and model.moe.num_experts. Expert optimizer state is sharded over the
    # dp / ep ranks that hold the same experts. 1: every rank holds every expert.
    ep: int = 1
    # Interleaved 1F1B (Megatron's virtual pipeline stages): each pipeline rank holds this many model chunks
    # (chunk c of rank p is layers block c * pp + p), so the bubble shrinks from (pp - 1) / n to
    # (pp - 1) / (v * n) of the step for n micro-batches, at v times the point-to-point messages. Turn it on when
    # the bubble is large (few micro-batches per rank against pp) and messages are cheap. Needs pp >= 2,
    # model.num_layers a multiple of pp * v and micro-batches a multiple of pp. 1: plain 1F1B.
    virtual_stages: int = 1
    # Start each bucket's data-parallel gradient reduction from the gradient hooks of the step's last
    # micro-batch, while backward goes on (megatier.optim.overlap). The shards each rank owns do not change.
    overlap_grad_reduce: bool = False
    # Start each bucket's parameter all-gather after the optimizer step and wait for it only in the forward
    # pre-hooks of the modules that use the bucket's parameters.
    overlap_param_gather: bool = False
    # MiB of fp32 gradient per bucket of the overlaps above; 0: 40.
    bucket_mb: float = 0.0
    # Seconds any collective may take before the run fails instead of hanging.
    timeout_s: float = 600.0

    def dp(self, world_size: int) -> int:
        """The data-parallel degree on ``world_size`` processes (validate() checks it divides)."""
        return world_size // (self.tp * self.pp)


LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "wsd")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


@dataclass
class OptimConfig:
    """AdamW with a warmup + decay LR schedule, global-norm clipping and a dynamic loss scaler. The schedule
    follows Megatron-core's (docs/configuration.md maps its flags to these keys)."""

    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_iters: int = 10
    # Set: the warmup is this fraction of decay_iters instead (then warmup_iters must be 0).
    warmup_fraction: Optional[float] = None
    # The rate the warmup starts from.
    warmup_init_lr: float = 0.0
    # None: decay over the whole run (train.iters).
    decay_iters: Optional[int] = None
    # After the warmup: constant | linear | cosine | inverse-square-root | wsd (warmup-stable-decay: lr until
    # the last wsd_decay_iters steps of decay_iters, then down to min_lr by wsd_decay_style).
    decay_style: str = "cosine"
    wsd_decay_iters: Optional[int] = None
    wsd_decay_style: str = "exponential"  # exponential | linear | cosine | minus_sqrt
    # true: a resume follows the schedule recorded with the job (the keys lr to wsd_decay_style above), whatever
    # this config sets; false: a changed schedule is refused unless checkpoint.allow_changes names its keys.
    # Not part of the fingerprint.
    use_checkpoint_scheduler: bool = False
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
    # The global gradient norm: "native" (torch, float64 sums) or "apex" (NVIDIA apex's fused multi-tensor L2 norm).
    grad_norm_impl: str = "native"


@dataclass
class DataConfig:
    """Token dataset. ``prefix`` names ``<prefix>.bin`` / ``<prefix>.idx`` from megatier-preprocess."""

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
    # Megatron's blends and splits (docs/data.md), instead of data.prefix; Megatron-format or MegaTier corpora.
    # Megatron's --data-path: [weight, prefix, weight, prefix, ...] or [prefix, ...] (weighted by size).
    blend: Optional[list[Any]] = None
    # Megatron's --split with data.blend: train,valid,test shares of each corpus's documents (None: "969,30,1").
    split: Optional[str] = None
    # Megatron's --train-data-path, --valid-data-path, --test-data-path: a blend per split (no data.blend/split).
    train_blend: Optional[list[Any]] = None
    valid_blend: Optional[list[Any]] = None
    test_blend: Optional[list[Any]] = None
    # Megatron's --mid-level-dataset-surplus: spare samples each corpus of a weighted blend is built with.
    mid_level_dataset_surplus: float = 0.005
    # Megatron's --train-samples for a blend: the training samples its order is built for (None: train.iters x
    # train.global_batch_size). The order depends on it, so a job that may train longer sets it that high at the
    # start; a relaunch with more train.iters and no room here is refused (docs/data.md, "Training longer").
    train_samples: Optional[int] = None
    # Read the next step's micro-batches on a background thread while the step runs (megatier.data.prefetch); the
    # samples are the same either way. false: read them in the loop (data_wait_ms then shows the whole read).
    prefetch: bool = True


@dataclass
class TrainConfig:
    """Loop settings. global_batch_size = micro_batch_size * dp * micro-batches per step."""

    iters: int = 100
    global_batch_size: int = 8
    micro_batch_size: int = 4
    # Batch-size ramp-up, Megatron's --rampup-batch-size: [start, increment, samples], the global batch starting
    # at start and growing by increment in even shares of samples until it is global_batch_size (None: none).
    rampup_batch_size: Optional[list[int]] = None
    seed: int = 1234
    precision: str = "fp32"  # fp32 | bf16 | fp16 | fp8 (Transformer Engine's fp8 GEMMs, bf16 elsewhere; model.impl=te)
    device: str = "auto"  # auto | cpu | cuda
    eval_interval: int = 50
    eval_iters: int = 2
    # None: leave torch's default.
    threads: Optional[int] = None
    # Time-limited jobs (Megatron's --exit-interval, --exit-duration-in-mins): stop cleanly, checkpoints durable,
    # exit 0, after every step that is a multiple of exit_interval, or after the last step that ends within
    # exit_duration_in_mins of the launch's start (leave the final drain room below the scheduler's limit).
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    # Megatron's --log-interval: the progress bar and the W&B/TensorBoard scalars every this many steps (and at the
    # last step); metrics.jsonl keeps every step, which goodput, megatier-plot and the tests read.
    log_interval: int = 1
    # Megatron's --eval-only / --skip-train: read the job's checkpoint (as megatier-convert export does, writing
    # nothing), evaluate it once (train.eval_iters batches) at its step, log val_loss and exit 0.
    eval_only: bool = False


@dataclass
class DiffStreamConfig:
    """Differential stream: every step's gradient shard, compressed, saved N steps per batch."""

    # N consecutive steps per diff batch, the unit of Tier-3 upload, commit and fused replay.
    batch: int = 5
    # Also store each step's record on Tier-1 and send it to the ring peer at once, so a failure loses at
    # most the step in flight, not the open batch (the step units are dropped when their batch is written).
    per_step: bool = True
    compression: str = "adaptive"  # adaptive | int8 | topk | bf16 | fp32 (fp32 replays bit for bit)
    topk_ratio: float = 0.01
    # adaptive: segments with fewer elements than this use blockwise INT8, larger ones top-k.
    small_threshold: int = 100_000
    # CPU threads of the loop's per-step compression (and its error-feedback add); 0: the loop's whole OpenMP
    # team. One by default: a parallel pass waits at its barrier for any team member that a helper thread or
    # another process preempted (the demo's compress spikes), and one thread does this pass in about the time
    # the team does on a shared 2-core box. GPU compression runs as kernels and ignores it.
    threads: int = 1


@dataclass
class PeerTierConfig:
    """Tier-2: replication to the same local rank on the next node of the ring."""

    # Cap on one paced chunk of a base replica.
    max_chunk_mib: float = 256.0


@dataclass
class LocalTierConfig:
    """Tier-1: node memory that outlives the process; files under <root>/<job_id>/<node>/."""

    root: str = "/dev/shm/megatier"
    # Newest own bases (with their diff chains) node memory keeps even while Tier-3 is behind; older units go.
    keep_bases: int = 2
    # Bytes this node's area may hold (own units and the replicas it keeps); above it only the newest base
    # and its chain are kept, and the metrics say Tier-1 is degraded. 0: no limit.
    budget_gib: float = 0.0


@dataclass
class RemoteTierConfig:
    """Tier-3: a directory (a shared file system) or s3://bucket/prefix; objects under <url>/<job_id>/."""

    url: str = "checkpoints"
    # S3-compatible endpoint (MinIO, moto, ...); None: AWS. Credentials come from the usual AWS environment.
    endpoint_url: Optional[str] = None
    # Committed bases kept on Tier-3 at or below the watermark.
    keep_bases: int = 2
    # Tier-3 gets every base_every-th base, counted from the anchor (the base written at start or after a
    # restore, always uploaded); Tier-1/Tier-2 keep every base and Tier-3 still gets every diff batch, so
    # the rack recovery point keeps moving every batch through the chain from Tier-3's newest base.
    base_every: int = 1
    # Directory remotes: fsync each object before it becomes visible (durable through a power loss of the
    # machine that wrote it). False for a file system that is durable on close (NFS, Lustre) or to match
    # baselines that do not fsync either; S3 ignores it.
    fsync: bool = True
    # At exit, how long to wait for Tier-3 uploads and the final commit before reporting what is behind.
    drain_timeout_s: float = 120.0
    # Rank 0 holds a lease on the job's Tier-3 prefix, renewed every lease_s / 3: a second live run of the
    # job refuses to start; a relaunch after a crash waits out the rest of the dead run's lease.
    lease_s: float = 15.0


@dataclass
class CheckFreeConfig:
    """checkpoint.last_resort=checkfree: a pipeline stage lost from every tier rebuilt from its two neighbours
    (megatier.checkpoint.recover.checkfree; CheckFree, arXiv:2506.15461, section 4.2). Not exact: the run says
    so from then on."""

    # The rebuilt stage's lr is the schedule's times this factor from the recovery on (the paper's 1.1).
    lr_scale: float = 1.1
    # How the stage's weights are rebuilt: "weighted" (the neighbours averaged, each weighted by its last
    # squared gradient norm: CheckFree), "copy" (the previous stage copied) or "random" (a fresh GPT-2
    # initialisation); copy and random are the paper's Figure 2 baselines, for comparison.
    init: str = "weighted"


@dataclass
class CheckpointConfig:
    """Tiered checkpointing (docs/architecture.md); checked by megatier.checkpoint.policy.rules."""

    enabled: bool = False
    tiers: list[str] = field(default_factory=lambda: ["local", "peer", "remote"])
    # Steps between base checkpoints: a multiple of diff.batch, or "auto" (chosen after a warm-up from the
    # measured costs and the MTBF; megatier.checkpoint.policy.auto_interval, docs/goodput.md).
    base_interval: Union[int, str] = 50
    # base_interval=auto: the cluster's mean time between failures in hours, or each node's (the cluster's is
    # then node_mtbf_hours / nodes); exactly one of the two. The warm-up (steps without a base after the
    # anchor, a multiple of diff.batch) and the largest interval auto may choose.
    mtbf_hours: Optional[float] = None
    node_mtbf_hours: Optional[float] = None
    auto_warmup_steps: int = 10
    auto_max_interval: int = 5000
    # How a base leaves the optimizer: "snapshot" (the whole shard copied at the base step) or "spread"
    # (capture_steps parts, one per step ending at the base step, reconciled by replay; see
    # megatier.checkpoint.save.capture).
    base_capture: str = "snapshot"
    capture_steps: int = 4
    # With spread: "checkflow" copies each part during the next step's operations, as a schedule solved once
    # from a profiled step places them (megatier.checkpoint.save.schedule); "none" copies it at the end of its step.
    capture_schedule: str = "checkflow"
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
    # When a whole pipeline stage is lost from every tier: "stop" with an error naming what is missing, or
    # "checkfree": rebuild it from its neighbours and go on at their recovery point (inexact; see checkfree).
    last_resort: str = "stop"
    checkfree: CheckFreeConfig = field(default_factory=CheckFreeConfig)
    # At exit, also write a base of the last step (to every tier, Tier-3 included): the final state is then a
    # base, exact to export and to resume, not only the replay of lossy diffs.
    final_base: bool = True
    # Config keys a relaunch may change and still resume this job's checkpoints (e.g. [optim.lr]);
    # ["*"] accepts any change. Others are refused, naming the keys (megatier.config.fingerprint).
    allow_changes: list[str] = field(default_factory=list)


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
    # TensorBoard beside W&B (Megatron's --tensorboard-dir): the same scalars, written by global rank 0 into
    # tensorboard_dir with torch.utils.tensorboard; needs the tensorboard package (pip install 'megatier[tensorboard]').
    tensorboard: bool = False
    tensorboard_dir: str = "${logging.run_dir}/tensorboard"


@dataclass
class ReliabilityConfig:
    """What the loop does with a step that is not finite (megatier.training.nonfinite), a suspicious step
    (megatier.training.sdc), and a job that keeps failing right after its restores (the restart-loop guard)."""

    # fp32/bf16, a step whose gradient norm is NaN or inf: "stop" the run (exit 5, one line naming the step, the
    # ranks and the tensors; the checkpoints end at the step before) or "skip_step" (nothing applied, the diff
    # stream records only the skip). fp16's loss scaler skips its overflows either way.
    on_nonfinite: str = "stop"
    # More skipped steps than this in a row (fp16 overflows, or skip_step) stop the run as diverged.
    max_consecutive_skips: int = 50
    # A step whose loss or gradient norm is not finite, or above this many times the median of the last 50
    # applied steps, runs its forward and backward again before anything is applied; a different result is a
    # transient fault (silent data corruption): the second is used, and the event logged. 0: only non-finite.
    spike_factor: float = 10.0
    # The restart-loop guard (megatier.checkpoint.recover.loops): a launch that fails within loop_window steps
    # of the point it restored, loop_limit times in a row without getting further, makes the next restore take
    # an older point (the previous base, then the newest Tier-3 base); when those loop too, the run stops
    # (exit 6). loop_limit=0 turns the guard off.
    loop_window: int = 10
    loop_limit: int = 2
    # Every this many steps the data-parallel replicas compare a digest (xxh64) of the parameters they hold in
    # common after the all-gather; a mismatch is named (ranks, step) and the base of that interval is kept
    # from Tier-3 (megatier.checkpoint.policy.replicas). 0: off.
    replica_check_interval: int = 0


@dataclass
class RecoveryConfig:
    """How surviving processes recover from a failure (megatier.training.inprocess, docs/checkpointing.md)."""

    # inprocess: the survivors keep their processes, re-form the job with hot spares through a membership round
    # and restore in place; used where a membership store is known (recovery.store, or the one megatier-agent
    # names), else the launch relaunches as with "relaunch". relaunch: any failure ends the launch; the next one
    # restores (torchrun restarts every worker anyway).
    mode: str = "inprocess"
    # host:port of the membership store (a TCPStore served by `megatier-agent --serve-store`); None: the one the
    # launcher's agent names (MEGATIER_MEMBERSHIP_STORE).
    store: Optional[str] = None
    # With no spare for a lost rank, seconds the round waits for a replacement process to join before it shrinks
    # dp (or gives up: see shrink).
    wait_for_replacement_s: float = 0.0
    # With no spare for a lost rank after that wait: true drops the data-parallel replicas it broke and the job
    # goes on in place with fewer (their surviving processes wait as spares); false ends the launch (exit 7)
    # for a relaunch.
    shrink: bool = True
    # Seconds the deciding survivor waits for members that neither joined the round nor were reported dead (a
    # hung process), and every member for the decision.
    round_timeout_s: float = 30.0
    # Seconds a node agent's heartbeat may stand still before the round counts the node lost, with every rank
    # and spare on it (a machine that died with its agent: nobody reports its processes).
    node_lease_s: float = 5.0


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
