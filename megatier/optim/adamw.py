"""DistributedAdamW: ZeRO-1 AdamW over flat fp32 shards.

Each dp rank owns one contiguous range of its model stage's flat parameter
space (and one of its routed experts' region: ``FlatLayout.shard_ranges``) and
keeps, for those ranges only, fp32 master weights and both Adam moments. A step reduce-scatters the gradients, unscales
and clips them with the true global norm, applies ``megatier.ops.adamw_step``
to the shard and all-gathers the parameters.

What the checkpoint system reads (valid after ``step`` returns):
  master, exp_avg, exp_avg_sq   flat fp32 shard state, shape (shard_size,)
  last_grad                     the exact gradient shard the step consumed
                                (reduced over dp, unscaled, clipped)
  last_lr, last_skipped         scalars of that step
  last_sumsq                    this rank's part of that step's squared gradient norm (before clipping;
                                each element counted on one rank), a float64 0-dim tensor: summed over a
                                pipeline stage's ranks, the stage's squared gradient norm (CheckFree's weight)
  lr_scale                      the factor on the schedule's lr (1.0; a stage CheckFree rebuilt runs faster)
  adam_steps                    applied (non-skipped) steps: the bias-correction count
  shard_segments                global names, offsets and shapes in the shard
                                (shapes are this tp rank's slice; names use
                                global layer indices, see FlatLayout)
"""
from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist

from megatier import ops
from megatier.config import OptimConfig
from megatier.optim.collectives import all_gather_flat
from megatier.optim.flat import FlatLayout, ranges_tensor
from megatier.optim.grad_buffer import GradBuffer
from megatier.optim.grad_norm import local_sumsq
from megatier.optim.loss_scaler import DynamicLossScaler
from megatier.optim.overlap import BucketedGather
from megatier.optim.schedule import LRSchedule

_FP32_MAX = torch.finfo(torch.float32).max


class Reduced(NamedTuple):
    """A step's gradient shard and the global sum of squares of the whole gradient."""

    grad: torch.Tensor
    sumsq: float


@dataclass(frozen=True)
class StepStats:
    lr: float
    grad_norm: float
    skipped: bool
    loss_scale: float


class DistributedAdamW:
    def __init__(self, cfg: OptimConfig, layout: FlatLayout, param_flat: torch.Tensor, grads: GradBuffer, *,
                 dp_rank: int, dp_group: dist.ProcessGroup, norm_group: dist.ProcessGroup,
                 schedule: LRSchedule, scaler: Optional[DynamicLossScaler] = None,
                 expert_dp_group: Optional[dist.ProcessGroup] = None):
        self.cfg, self.layout, self.param_flat, self.grads = cfg, layout, param_flat, grads
        self.dp_rank, self.dp_group, self.norm_group = dp_rank, dp_group, norm_group
        self.expert_dp_group = expert_dp_group  # routed experts' shards (parallel.ep > 1)
        self.schedule, self.scaler = schedule, scaler
        self.shard_segments = layout.shard_segments(dp_rank)
        self._param_shards = [param_flat[lo:hi] for lo, hi in layout.shard_ranges(dp_rank)]
        self.master = torch.cat([p.detach().float() for p in self._param_shards])
        self.exp_avg = torch.zeros_like(self.master)
        self.exp_avg_sq = torch.zeros_like(self.master)
        self.decay_ranges = ranges_tensor(self.shard_segments, "decay")
        self._norm_ranges = ranges_tensor(self.shard_segments, "in_norm").tolist()
        self.adam_steps = 0
        self.last_grad = torch.zeros_like(self.master)
        self.last_lr = 0.0
        self.last_skipped = False
        self.last_sumsq: Optional[torch.Tensor] = None
        self.lr_scale = 1.0
        self._pre_step_hooks: list[Callable[[int], None]] = []
        self.gather: Optional[BucketedGather] = None  # parallel.overlap_param_gather (megatier.optim.overlap.attach)

    def register_pre_step_hook(self, hook: Callable[[int], None]) -> None:
        """``hook(iteration)`` runs in every :meth:`step` after the gradient is reduced, before the state changes
        (the spread base capture finishes its copies there)."""
        self._pre_step_hooks.append(hook)

    def before_update(self, iteration: int) -> None:
        """Run the pre-step hooks: the last moment the state is still that of the previous step."""
        for hook in self._pre_step_hooks:
            hook(iteration)

    def _global_sumsq(self, grad: torch.Tensor) -> float:
        # Squares of every gradient element counted exactly once over all ranks.
        local = local_sumsq(grad, self._norm_ranges, self.cfg.grad_norm_impl)
        self.last_sumsq = local.clone()
        dist.all_reduce(local, group=self.norm_group)
        return float(local)

    def reduce(self) -> "Reduced":
        """This step's gradient shard (the mean over dp, unscaled) and the job's sum of its squares. The state is
        untouched, so a step whose forward and backward run again can be reduced again (megatier.training.sdc)."""
        self.wait_params()  # backward is over: nothing may still write the parameters
        grad = self.grads.reduce_scatter_mean(self.dp_rank)
        if self.scaler is not None and self.scaler.scale != 1.0:
            grad.div_(self.scaler.scale)
        return Reduced(grad, self._global_sumsq(grad))

    def step(self, iteration: int, reduced: Optional["Reduced"] = None) -> StepStats:
        """Apply optimizer step for training iteration ``iteration`` (1-based; it picks the lr) to ``reduced``
        (:meth:`reduce`'s, taken now when not given). The pre-step hooks run first: the state changes after."""
        grad, sumsq = reduced if reduced is not None else self.reduce()
        self.before_update(iteration)
        scale = self.scaler.scale if self.scaler is not None else 1.0
        # Not finite, or a gradient element whose square overflows fp32: that square would make exp_avg_sq inf
        # (the norm is summed in float64, so it alone stays finite).
        overflow = not math.isfinite(sumsq) or sumsq > _FP32_MAX
        if self.scaler is not None:
            self.scaler.update(overflow)
        norm = math.sqrt(sumsq) if not overflow else float("inf")
        lr = self.schedule(iteration) * self.lr_scale
        self.last_lr, self.last_skipped = lr, overflow
        if overflow:
            # fp16 overflow, or a non-finite gradient (megatier.training.nonfinite says what the run does next):
            # nothing is applied; the Adam count does not advance.
            self.last_grad = grad
            return StepStats(lr, norm, True, scale)
        if self.cfg.clip_grad > 0 and norm > self.cfg.clip_grad:
            grad.mul_(self.cfg.clip_grad / (norm + 1e-6))
        self.last_grad = grad
        self.adam_steps += 1
        ops.adamw_step(self.master, self.exp_avg, self.exp_avg_sq, grad, self.adam_steps, lr,
                       self.cfg.beta1, self.cfg.beta2, self.cfg.eps, self.cfg.weight_decay, self.decay_ranges)
        self.publish_params(step_wait=True)
        return StepStats(lr, norm, False, scale)

    def publish_params(self, *, step_wait: bool = False) -> None:
        """Copy the master shard into the model's parameters on every dp rank (routed experts' on every rank of
        their expert-data-parallel group); ``step_wait``: a training step's all-gather (its time counts as
        ``dp_param_wait_ms``), not a restore's. A step's gather by buckets (``parallel.overlap_param_gather``)
        is only started here; the next forward's hooks, or :meth:`wait_params`, wait for it."""
        if self.gather is not None and not step_wait:
            self.gather.discard()
        groups = [(self.dp_group, self.layout.dp), (self.expert_dp_group or self.dp_group, self.layout.edp)]
        regions = [self.param_flat[:self.layout.dense_numel], self.param_flat[self.layout.dense_numel:]]
        for mine, master in zip(self._param_shards, self.master.split([p.numel() for p in self._param_shards])):
            mine.copy_(master)
        if self.gather is not None and step_wait:
            self.gather.launch(self.param_flat, (groups[0][0], groups[1][0]))
            return
        for mine, region, (group, size) in zip(self._param_shards, regions, groups):
            if size > 1:
                with self.grads.clock.timing("dp_param_wait_ms") if step_wait else nullcontext():
                    all_gather_flat(region, mine.clone(), group)

    def wait_params(self) -> None:
        """Wait until every parameter holds the last step's values (a no-op unless a bucketed gather is in
        flight); whoever reads the parameter buffer outside a module's forward calls it first."""
        if self.gather is not None:
            self.gather.wait()

    def take_wait_ms(self) -> dict[str, float]:
        """The data-parallel communication the steps since the last call waited for, in ms: the gradient
        reduce-scatter (``dp_grad_wait_ms``), the parameter all-gather (``dp_param_wait_ms``) and their sum
        (``dp_wait_ms``); all 0.0 with dp = 1."""
        waits = self.grads.clock.take("dp_grad_wait_ms", "dp_param_wait_ms")
        return {"dp_wait_ms": sum(waits.values()), **waits}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"master": self.master, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
