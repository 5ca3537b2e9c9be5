"""How the training loop sees checkpointing: the Checkpointer protocol and the default factory.

The Trainer knows three calls and nothing else:

    step, record = checkpointer.restore()   # before the loop: the step the state is at, the recovery record
    metrics = checkpointer.after_step(s)     # after optimizer step s; merged into the step's metrics
    checkpointer.close(failed=...)           # at exit: drain what is in flight

and, only for in-process recovery, ``checkpointer.abort(timeout)`` when the job's world broke: stop without a
collective, keeping what node memory holds (a checkpointer without it makes such a failure end the launch).

``Trainer(cfg, checkpointer=factory)`` takes a factory that gets the
:class:`TrainState` once the model and optimizer exist; without one it uses
:func:`build_checkpointer` (the tiered :class:`CheckpointManager`) when
``checkpoint.enabled``. Tests and the benchmark's baselines inject theirs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

from torch import nn

from megatier.checkpoint.context import build_context
from megatier.checkpoint.manager import CheckpointManager
from megatier.checkpoint.shard import ShardAccess
from megatier.checkpoint.storage.store import ObjectStore
from megatier.config import CheckpointConfig, ReliabilityConfig
from megatier.faults import FaultInjector


class Checkpointer(Protocol):
    def restore(self) -> tuple[int, Optional[dict]]:
        """Bring the training state to the newest recoverable step (0: a fresh start) and say how."""

    def after_step(self, step: int) -> dict:
        """Checkpoint work after optimizer step ``step``; returns metrics for the step's record."""

    def close(self, *, failed: bool = False) -> Optional[dict]:
        """Finish what is in flight (collective where the checkpointer's work is); the final status, merged into
        the run's summary record (for the tiered checkpointer: ``checkpoint_behind`` and the durable step).
        ``failed``: the launch ends on a failure it found itself (a diverged step), which the restart-loop guard
        counts like a crash."""


@dataclass(frozen=True)
class TrainState:
    """What a checkpointer may read and restore: the layout, the model stage and its ZeRO-1 optimizer."""

    ps: Any  # ParallelState
    model: nn.Module
    optimizer: Any  # DistributedAdamW
    global_batch_size: int
    fingerprint: dict = field(default_factory=dict)  # megatier.config.fingerprint.state_fingerprint
    followed: tuple[str, ...] = ()  # fingerprint keys taken from the job's record (fingerprint.followed_keys)


CheckpointerFactory = Callable[[TrainState], Checkpointer]


def build_checkpointer(cfg: CheckpointConfig, state: TrainState, *, timeout_s: float,
                       fault: Optional[FaultInjector] = None, remote_store: Optional[ObjectStore] = None,
                       reliability: Optional[ReliabilityConfig] = None, reformed: bool = False) -> CheckpointManager:
    """The tiered checkpointer of ``cfg`` for this rank (collective: every rank calls it); see build_context."""
    ctx = build_context(cfg, state.ps, timeout_s=timeout_s, fault=fault, remote_store=remote_store,
                        fingerprint=state.fingerprint, followed=state.followed, reliability=reliability,
                        reformed=reformed)
    return CheckpointManager(ctx, ShardAccess(state.optimizer, state.global_batch_size), model=state.model)
