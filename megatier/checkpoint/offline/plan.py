"""Size planner: the bytes a job's checkpoints take per rank, per node and per tier, before it is launched.

From a config and a cluster shape alone, without process groups or tensors, it describes what the Trainer
would build: each stage's parameters (``model.gpt.stage_parameters``), the flat layout cut into dp shards
(``optim.flat.FlatLayout``), and the shard as :class:`~.shard.ShardAccess` sees it. The payloads are then
drafted by the code that writes real ones (``format.payload``), over meta tensors, so every size is a
serialized size, safetensors header and metadata included:

    base        fp32 master weights, exp_avg and exp_avg_sq of the rank's ZeRO-1 shard, its RNG state,
                the schedule, data position and segment table
    diff batch  ``diff.batch`` steps' compressed records (``ops.planned_record``: exact for int8, bf16 and
                fp32; top-k at the count it aims for, a real record keeps within half to twice that)
    step unit   one step's record on its own (``diff.per_step``), kept until its batch is written

What each tier keeps follows ``reclaim/policy.py`` (:func:`retention`). A rank's node memory (Tier-1, and its
Tier-2 replica on the next node of the ring) holds bases at or above the reclaim floor, max(watermark W,
the ``local.keep_bases``-th newest base), and the diffs after it, plus the step units of the open batch.
Tier-3 keeps the bases at or above W and ``remote.keep_bases`` committed ones at or below it, and the diff
batches after the committed base preceding W. A node's memory is its ranks' Tier-1 plus the Tier-2 replicas
of the same local ranks of the node before it in the ring.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatier import ops
from megatier.checkpoint.format.payload import DiffStep, draft_base, draft_diff_batch
from megatier.checkpoint.policy.rules import (
    CheckpointConfigWarning,
    check_checkpoint_config,
    effective_checkpoint_config,
)
from megatier.checkpoint.shard import ShardAccess
from megatier.config import CheckpointConfig, Config, validate
from megatier.data.corpus import default_corpus_prefix
from megatier.data.indexed import read_index
from megatier.data.ramp import BatchRamp
from megatier.data.tokenizer import ByteTokenizer
from megatier.model.params import stage_parameters, stage_spec
from megatier.optim.flat import FlatLayout, ShardSegment
from megatier.optim.loss_scaler import DynamicLossScaler
from megatier.optim.schedule import LRSchedule, schedule_of
from megatier.parallel.layout import Layout, coordinates_of

# Steps from a base until node memory learns it is committed (the watermark): its upload commits within the
# next diff batch, the watermark sync at that batch's end learns it, and the sync is applied one batch later.
COMMIT_LAG_BATCHES = 2
_FINGERPRINT = "0" * 16  # a config fingerprint's length (fingerprint_hash); its digits change no size


class PlanError(ValueError):
    """The config or cluster cannot be planned; one line naming the fields and the fix."""


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``procs_per_node`` processes; node n runs ranks n * procs_per_node onward (the launcher's)."""

    nodes: int
    procs_per_node: int

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.procs_per_node


@dataclass(frozen=True)
class RankSizes:
    """One rank's payloads in bytes, as serialized."""

    layout: Layout
    node: int
    shard_numel: int
    base: int
    diff_batch: int  # diff.batch steps
    step_unit: int  # one step's record on its own (0 without diff.per_step)


@dataclass(frozen=True)
class Retention:
    """How much of one rank a tier holds at most: bases, steps of diffs in closed batches, step units."""

    bases: int
    diff_steps: int
    step_units: int

    def bytes(self, r: RankSizes, batch: int) -> int:
        return self.bases * r.base + self.diff_steps // batch * r.diff_batch + self.step_units * r.step_unit


def _held(spacing: int, batch: int, base_floor: Callable[[int], int], diff_floor: Callable[[int], int],
          ends: range) -> tuple[int, int]:
    """The most bases (``spacing`` steps apart) and steps of diffs a tier holds over the batch ends ``ends``,
    counted after the units of s arrive and before the reclaim at s: the bases from ``base_floor(s)`` to s and
    the diffs after ``diff_floor(s)``, the floors the reclaims before s left."""
    return (max(s // spacing - base_floor(s) // spacing + 1 for s in ends), max(s - diff_floor(s) for s in ends))


def retention(c: CheckpointConfig) -> dict[str, Retention]:
    """What each tier keeps of a rank at most, by case (``reclaim/policy.py``), in steady state:

    node        node memory while Tier-3 keeps up: the reclaim floor is max(watermark, the
                ``local.keep_bases``-th newest base); the watermark is the newest base Tier-3 has committed
                (every ``remote.base_every``-th base goes there), learned COMMIT_LAG_BATCHES batches after it
    node_bound  node memory while Tier-3 is behind, down or absent: the floor is the ``local.keep_bases``-th
                newest base (its bases and chains, plus a new base until the reclaim that follows it)
    tier3       Tier-3: the ``remote.keep_bases`` newest committed bases at or below the watermark and the newer
                one uploading, and the diffs after the committed base before the watermark
    """
    interval, batch, keep = c.base_interval, c.diff.batch, c.local.keep_bases
    remote_keep, durable = c.remote.keep_bases, c.remote.base_every * c.base_interval  # Tier-3's base spacing
    lag = COMMIT_LAG_BATCHES * batch
    start = durable * (max(keep, remote_keep) + 2 + lag // durable)  # past the start: every floor is a base
    ends = range(start, start + durable, batch)  # one period of the pattern

    def watermark(s: int) -> int:  # the newest base on Tier-3, as the reclaim at the batch end before s learned it
        return durable * ((s - batch - lag) // durable)

    def kept(s: int) -> int:  # the keep-th newest base at the batch end before s
        return interval * ((s - batch) // interval - keep + 1)

    def floor(s: int) -> int:
        return max(watermark(s), kept(s))

    units = batch - 1 if c.diff.per_step else 0
    bound = Retention(*_held(interval, batch, kept, kept, ends), units)
    typical = Retention(*_held(interval, batch, floor, floor, ends), units)
    tier3 = _held(durable, batch, lambda s: watermark(s) - (remote_keep - 1) * durable,
                  lambda s: watermark(s) - durable, ends)
    return {"node": typical if "remote" in c.tiers else bound, "node_bound": bound,
            "tier3": Retention(*tier3, 0)}


def vocab_size(cfg: Config) -> tuple[int, str]:
    """The true vocabulary the Trainer would take (``model.vocab_size``, else the dataset's) and where from."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size, "model.vocab_size"
    d = cfg.data
    prefix = d.prefix or default_corpus_prefix(d.cache_dir, d.tokenizer, d.default_corpus_mib, d.bpe_vocab_size)
    try:
        return int(read_index(prefix + ".idx")[1]["vocab_size"]), f"{prefix}.idx"
    except (OSError, ValueError, KeyError) as e:
        if d.prefix is not None:
            raise PlanError(f"data.prefix={d.prefix}: cannot read its vocabulary ({e}); give a prefix "
                            f"megatier-preprocess wrote, or model.vocab_size") from e
    if d.tokenizer == "byte":
        return ByteTokenizer.vocab_size, "the byte tokenizer"
    return d.bpe_vocab_size, "data.bpe_vocab_size (the default corpus is not built yet)"


def shard_segments(cfg: Config, layout: Layout, vocab: int) -> tuple[list[ShardSegment], int]:
    """The segment table and element count of ``layout``'s ZeRO-1 shard, as the Trainer would build them."""
    spec = stage_spec(cfg.model, tp=layout.tp, pp=layout.pp, tp_rank=layout.tp_rank, pp_rank=layout.pp_rank,
                      virtual_stages=cfg.parallel.virtual_stages)
    params = stage_parameters(cfg.model, vocab, spec)
    flat = FlatLayout.from_params(params, layout.dp, tp_rank=layout.tp_rank)
    return flat.shard_segments(layout.dp_rank), flat.shard_size


@dataclass
class _PlannedOptimizer:
    """What ShardAccess reads of a DistributedAdamW, for a shard never allocated: its segments, a meta master
    (dtype and size), the config's LR schedule and loss scaler, and the Adam count of the planned step."""

    shard_segments: list[ShardSegment]
    master: torch.Tensor
    schedule: LRSchedule
    scaler: Optional[DynamicLossScaler]
    adam_steps: int
    last_sumsq: Optional[torch.Tensor] = None
    lr_scale: float = 1.0


def rank_sizes(cfg: Config, layout: Layout, node: int, vocab: int) -> RankSizes:
    """Draft one rank's base, diff batch and step unit at the run's last step (the widest numbers) and size them."""
    c, o, t = cfg.checkpoint, cfg.optim, cfg.train
    segments, numel = shard_segments(cfg, layout, vocab)
    scaler = None
    if t.precision == "fp16":
        scaler = DynamicLossScaler(o.initial_loss_scale, o.min_loss_scale, o.loss_scale_window, o.hysteresis)
    schedule = schedule_of(o, t.iters, t.global_batch_size, BatchRamp.of(t.global_batch_size, t.rampup_batch_size))
    step = max(t.iters, c.diff.batch)
    meta = torch.empty(numel, dtype=torch.float32, device="meta")
    shard = ShardAccess(_PlannedOptimizer(segments, meta, schedule, scaler, step), t.global_batch_size)
    base = shard.base_of(step, {"master": meta, "exp_avg": meta, "exp_avg_sq": meta})
    ids = dict(job_id=c.job_id, layout=layout, fingerprint=_FINGERPRINT)
    d = c.diff
    record = ops.planned_record([n for _, n in shard.segments], d.compression, d.topk_ratio, d.small_threshold,
                                seed=step)
    steps = [DiffStep(s, schedule(s), s, False, dict(record.tensors), record.header)
             for s in range(step - d.batch + 1, step + 1)]
    unit = draft_diff_batch(steps[-1:], step_unit=True, **ids).size if d.per_step else 0
    return RankSizes(layout, node, numel, draft_base(base, **ids).size, draft_diff_batch(steps, **ids).size, unit)


@dataclass
class SizePlan:
    """Every rank's payload sizes and what each tier holds of them (see :func:`retention`)."""

    ckpt: CheckpointConfig  # as it takes effect on the cluster (no peer tier on one node)
    cluster: Cluster
    vocab: tuple[int, str]
    ranks: list[RankSizes]
    notes: list[str] = dataclasses.field(default_factory=list)  # how the cluster changed the checkpoint config

    @property
    def retention(self) -> dict[str, Retention]:
        return retention(self.ckpt)

    def held(self, r: RankSizes, case: str) -> int:
        """Bytes ``case`` of :func:`retention` holds of rank ``r`` (0 where its tier is not in use)."""
        tier = "remote" if case == "tier3" else "local"
        return self.retention[case].bytes(r, self.ckpt.diff.batch) if tier in self.ckpt.tiers else 0

    def node_bytes(self, node: int, case: str) -> int:
        """Node ``node``'s memory: its ranks' Tier-1 and the Tier-2 replicas of the node before it in the ring."""
        ppn, n = self.cluster.procs_per_node, self.cluster.nodes
        own = sum(self.held(r, case) for r in self.ranks[node * ppn:(node + 1) * ppn])
        if "peer" not in self.ckpt.tiers:
            return own
        before = (node - 1) % n
        return own + sum(self.held(r, case) for r in self.ranks[before * ppn:(before + 1) * ppn])

    def tier3_bytes(self) -> int:
        return sum(self.held(r, "tier3") for r in self.ranks)


def plan(cfg: Config, cluster: Cluster) -> SizePlan:
    """The size plan of ``cfg`` on ``cluster``; PlanError (one line) when it cannot run there."""
    if cluster.nodes < 1 or cluster.procs_per_node < 1:
        raise PlanError(f"{cluster.nodes} nodes x {cluster.procs_per_node} processes: both must be >= 1")
    try:
        validate(cfg, cluster.world_size)
        check_checkpoint_config(cfg.checkpoint)
    except ValueError as e:
        raise PlanError(str(e)) from e
    if not cfg.checkpoint.enabled:
        raise PlanError("checkpointing is off in this config (checkpoint.enabled=false); plan with checkpoint=tiered")
    with warnings.catch_warnings(record=True) as caught:  # what the topology changes goes into the plan's notes
        warnings.simplefilter("always", CheckpointConfigWarning)
        ckpt = effective_checkpoint_config(cfg.checkpoint, cluster.nodes)
    notes = [str(w.message) for w in caught]
    if ckpt.base_interval == "auto":  # chosen at run time: plan the largest it may take, the most memory
        ckpt = dataclasses.replace(ckpt, base_interval=ckpt.auto_max_interval)
        notes.append(f"base_interval=auto is chosen at run time; planned at its largest, auto_max_interval="
                     f"{ckpt.auto_max_interval}")
    cfg = dataclasses.replace(cfg, checkpoint=ckpt)
    vocab = vocab_size(cfg)
    p = cfg.parallel
    dp = p.dp(cluster.world_size)
    ranks = []
    for rank in range(cluster.world_size):
        tp_rank, dp_rank, pp_rank = coordinates_of(rank, tp=p.tp, dp=dp)
        layout = Layout(p.tp, p.pp, dp, tp_rank, pp_rank, dp_rank)
        ranks.append(rank_sizes(cfg, layout, cluster.node_of(rank), vocab[0]))
    return SizePlan(ckpt, cluster, vocab, ranks, notes)
