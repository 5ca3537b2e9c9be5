"""The Trainer's in-process recovery (``recovery.mode=inprocess``): what a surviving process does when a
collective fails because a peer died or hung.

It re-forms the job through a membership round (:mod:`megatier.training.inprocess`) and restores in place:

* same layout (a spare took each lost rank): the model, optimizer, gradient buffer, guard and pipeline comm are
  re-pointed at the new groups, and a rank whose memory is at the agreed end reads nothing;
* fewer replicas (no spare: ``recovery.shrink``): a survivor whose rank or dp changed builds the layout's
  components again (:meth:`Trainer._build_components`) and restores resharded; a survivor of a dropped replica
  frees its state and waits like a hot spare for a later round.

:class:`InPlaceRecovery` is a mixin of :class:`~megatier.training.trainer.Trainer`: it uses the Trainer's
config, parallel state, membership, checkpointer and builders.
"""
from __future__ import annotations

import gc
import logging
import time

import torch.distributed as dist

from megatier.config import ConfigError, validate
from megatier.observe.goodput import NullLedger
from megatier.observe.metrics import NullLogger
from megatier.parallel.state import attach_groups, detach_groups
from megatier.training.inprocess import JobEnded, become_rank
from megatier.training.outcome import DIVERGED, refusal

log = logging.getLogger(__name__)


class InPlaceRecovery:
    """Recovery without a relaunch, for the Trainer (see the module docstring)."""

    def _recoverable(self, error: RuntimeError) -> bool:
        """Whether ``error`` (a collective or checkpoint transfer that failed: a peer died or hung) is recovered
        in place: only with a membership store and a checkpointer that can stop without a collective, and
        not twice at the same step (a failure that recurs there is this process's own: the launch ends)."""
        if self.membership is None or not hasattr(self.checkpointer, "abort"):
            return False
        if isinstance(error, DIVERGED) or refusal(error) is not None:  # a stop or a refusal, not a lost peer
            return False
        return self._recovered_at != self.step

    def _recover_in_place(self, failure: str) -> None:
        """Re-form the job with the survivors and spares and restore in place: the same layout keeps model,
        optimizer and data; a shrunk one (no spare: recovery.shrink) builds them for the new layout, and a
        survivor whose replica was dropped waits as a spare."""
        self.detected_at = time.time()
        live = None if self._updating else self.step
        self._updating = False
        if self.ps.rank == 0:
            log.warning("step %d: a peer failed (%s); recovering in place (recovery.mode=inprocess)", self.step + 1,
                        failure)
        holders = [*self.model.modules(), self.optimizer, self.grads, self.nonfinite,
                   *([self.comm] if self.comm is not None else [])]
        detached = detach_groups(holders, self.ps)
        rank, degrees = self.ps.rank, self.ps.degrees
        dist.destroy_process_group()
        self.checkpointer.abort(timeout=min(10.0, self.cfg.parallel.timeout_s))
        self.checkpointer = self.ps = None  # the last references: the old groups close, blocked peers fail now
        gc.collect()
        new_rank = self.membership.survive(degrees, self._trainable_dp)
        if new_rank is None:
            new_rank = self._wait_as_spare()
        become_rank(self.membership, new_rank)
        self._form_world()
        if (new_rank, self.ps.degrees) == (rank, degrees) and self.model is not None:
            attach_groups(detached, self.ps)
            self._fit_checkpointing()
            self.checkpointer = self._build_checkpointer(self._factory)
            self.checkpointer.shard.live_version = live
        else:  # another rank or dp: the state is resharded from the checkpoints, as after an elastic relaunch
            log.info("member %s re-forms as rank %d of tp=%d pp=%d dp=%d (was rank %d of dp=%d)",
                     self.membership.me.id, new_rank, *self.ps.degrees, rank, degrees[2])
            del detached
            if self.grads is not None:
                self.grads.remove_hooks()
            self._build_components()
        self._recovered_at = self.step
        self.restore()
        self.checkpointer.shard.live_version = None

    def _trainable_dp(self, dp: int) -> bool:
        """Whether this job's configuration trains with ``dp`` data-parallel replicas (a shrink's choice)."""
        try:
            validate(self.cfg, dp * self.cfg.parallel.tp * self.cfg.parallel.pp)
        except ConfigError:
            return False
        return True

    def _wait_as_spare(self) -> int:
        """The round dropped this process's replica: free its training state (rank 0's metrics pass to the new
        rank 0) and wait like a hot spare for a later round's rank; JobEnded when the job needs it no more."""
        log.info("member %s: its data-parallel replica was dropped; waiting as a spare", self.membership.me.id)
        self.logger.close()
        self.logger, self.goodput = NullLogger(), NullLedger()
        self.grads.remove_hooks()
        self.model = self.optimizer = self.grads = self.batches = self.comm = None
        gc.collect()
        rank = self.membership.await_rank()
        if rank is None:
            raise JobEnded(f"member {self.membership.me.id} was not needed again before the job ended")
        self.detected_at = self.membership.assigned_at
        return rank
