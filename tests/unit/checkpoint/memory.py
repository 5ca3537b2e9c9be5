"""In-memory stand-ins for testing the checkpoint policy and the recovery path without threads or groups.

:class:`MemoryTier` keeps units in a dict and implements the Tier interface the
way the real tiers do (verified reads, deletion, a recovery point, a durable
base when it plays Tier-3). :func:`tiny_shard` is a real ZeRO-1 optimizer shard
of a small module in a world of one, stepped by :func:`step` with the
optimizer's own kernel, as the training loop would.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatier import ops
from megatier.checkpoint.comm import SoloComm
from megatier.checkpoint.context import CheckpointContext
from megatier.checkpoint.format.chain import chain_end
from megatier.checkpoint.format.payload import EncodedPayload, verify_payload
from megatier.checkpoint.format.units import BASE, DIFF, PayloadId
from megatier.checkpoint.reclaim.policy import beyond_end, local_reclaim_set
from megatier.checkpoint.shard import ShardAccess
from megatier.checkpoint.storage.store import ObjectNotFound
from megatier.checkpoint.tiers.base import NODE, TIER3, Copy, Listing, Tier
from megatier.config import CheckpointConfig, DiffStreamConfig, OptimConfig
from megatier.optim.adamw import DistributedAdamW
from megatier.optim.flat import FlatLayout, flatten_parameters
from megatier.optim.grad_buffer import GradBuffer
from megatier.optim.schedule import LRSchedule
from megatier.parallel.layout import Layout

JOB = "memjob"
NODE0 = "node0"


class MemoryTier(Tier):
    """A tier in a dict; as Tier-3 (label TIER3, job scope) every unit put counts as committed at once."""

    def __init__(self, label: str, *, scope: str = NODE, lockstep: bool = False, rank: int = 0,
                 takes_steps: bool = False):
        self.label, self.scope, self.lockstep, self.rank = label, scope, lockstep, rank
        self.takes_steps = takes_steps
        self.node = NODE0 if scope == NODE else None
        self.units: dict[tuple[int, PayloadId], EncodedPayload] = {}
        self.puts: list[tuple[Optional[int], PayloadId]] = []  # (last tick seen when put, unit)
        self.ticks: list[int] = []
        self.watermarks: list[int] = []
        self.started = self.closed = False
        self.restores: list[dict] = []  # the job's restore history, as the real tiers keep it

    def put(self, payload: EncodedPayload) -> None:
        pid = payload.stamp.pid
        self.units[(payload.stamp.rank, pid)] = EncodedPayload(bytes(payload.data), payload.stamp)
        self.puts.append((self.ticks[-1] if self.ticks else None, pid))
        if pid.kind == DIFF:  # as node memory does: a complete batch replaces the step units it covers
            for s in range(pid.first, pid.last + 1):
                self.units.pop((payload.stamp.rank, PayloadId.step(s)), None)

    def list(self) -> Listing:
        copies = [Copy(p.stamp, self.label, self.node) for p in self.units.values()]
        return Listing(copies=copies, traces=bool(self.units), restores=list(self.restores))

    def record_restores(self, history: list[dict]) -> None:
        self.restores = [dict(e) for e in history]

    def read(self, copy: Copy) -> EncodedPayload:
        payload = self.units.get((copy.owner, copy.pid))
        if payload is None:
            raise ObjectNotFound(f"{self.label}: no {copy.pid} of rank {copy.owner}")
        verify_payload(payload.data, payload.stamp, f"{self.label} {copy.pid}")
        return payload

    def delete(self, pid: PayloadId, owner: Optional[int] = None) -> None:
        for key in [k for k in self.units if k[1] == pid and owner in (None, k[0])]:
            del self.units[key]

    def held(self) -> list[PayloadId]:
        return sorted(pid for owner, pid in self.units if owner == self.rank)

    def on_step(self, step: int) -> float:
        self.ticks.append(step)
        return 0.0

    def point(self) -> Optional[int]:
        held = self.held()
        return chain_end({p.version for p in held if p.kind == BASE}, [p for p in held if p.kind != BASE])

    def durable_base(self) -> Optional[int]:
        if self.label != TIER3:
            return None
        return max((p.version for p in self.held() if p.kind == BASE), default=None)

    def reclaim(self, watermark: Optional[int]) -> None:
        self.watermarks.append(watermark)
        if self.label != TIER3 and watermark is not None:
            for pid in local_reclaim_set(self.held(), watermark):
                self.delete(pid, self.rank)

    def start(self) -> None:
        self.started = True

    def close(self, timeout: float) -> None:
        self.closed = True

    def discard_after(self, end: int) -> list[str]:
        gone = beyond_end(self.held(), end)
        for pid in gone:
            self.delete(pid)
        return [f"{self.label} {pid}" for pid in sorted(gone)]


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.w = nn.Parameter(torch.randn(6, 5, generator=g))
        self.b = nn.Parameter(torch.randn(5, generator=g))
        for p in self.parameters():
            p.tp_partition_dim = None


def tiny_shard(iters: int = 40) -> tuple[DistributedAdamW, ShardAccess]:
    """A fresh world-of-one ZeRO-1 shard (the optimizer never calls a collective when dp == 1 and it is
    stepped through :func:`step`)."""
    model = _Tiny()
    layout = FlatLayout.from_module(model, 1, tp_rank=0)
    flat = flatten_parameters(model, layout, torch.float32, torch.device("cpu"))
    grads = GradBuffer(model, layout, torch.device("cpu"), dp_group=None)
    cfg = OptimConfig(lr=1e-2, min_lr=1e-3, warmup_iters=3, weight_decay=0.1)
    opt = DistributedAdamW(cfg, layout, flat, grads, dp_rank=0, dp_group=None, norm_group=None,
                           schedule=LRSchedule(1e-2, 1e-3, 3, iters))
    opt._model = model  # keep the parameters' owner alive with the flat buffer
    return opt, ShardAccess(opt, global_batch_size=4)


def step(opt: DistributedAdamW, s: int) -> None:
    """Optimizer step ``s`` with a fixed pseudo-random gradient, exposing what a real step exposes."""
    grad = torch.randn(opt.master.shape, generator=torch.Generator().manual_seed(1000 + s))
    opt.before_update(s)
    c = opt.cfg
    opt.last_grad, opt.last_lr, opt.last_skipped = grad, opt.schedule(s), False
    opt.adam_steps += 1
    ops.adamw_step(opt.master, opt.exp_avg, opt.exp_avg_sq, grad, opt.adam_steps, opt.last_lr, c.beta1, c.beta2,
                   c.eps, c.weight_decay, opt.decay_ranges)
    opt.publish_params()


def snapshot(opt: DistributedAdamW) -> dict:
    return {"master": opt.master.clone(), "exp_avg": opt.exp_avg.clone(), "exp_avg_sq": opt.exp_avg_sq.clone(),
            "adam_steps": opt.adam_steps, "params": opt.param_flat.clone()}


def context(tiers: list[Tier], *, base_interval: int = 10, batch: int = 5) -> CheckpointContext:
    cfg = CheckpointConfig(enabled=True, job_id=JOB, base_interval=base_interval,
                           diff=DiffStreamConfig(batch=batch, compression="fp32"))
    return CheckpointContext(cfg, Layout(1, 1, 1, 0, 0, 0), NODE0, tiers, SoloComm(), timeout_s=5.0)
