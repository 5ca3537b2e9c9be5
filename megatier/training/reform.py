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

import functools
import gc
import logging
import time
from typing import Callable, Optional, TypeVar

import torch.distributed as dist

from megatier.observe.goodput import NullLedger
from megatier.observe.metrics import NullLogger
from megatier.parallel.state import attach_groups, detach_groups
from megatier.training.inprocess import JobEnded, become_rank, trainable_dp
from megatier.training.outcome import DIVERGED, refusal

log = logging.getLogger(__name__)
T = TypeVar("T")


class InPlaceRecovery:
    """Recovery without a relaunch, for the Trainer (see the module docstring)."""

    _intact = False  # the in-memory state is exactly step ``self.step`` (not mid-restore, not a fresh build)
    _recovering = False  # between a failure and the end of the restore that recovers it
    _detached = None  # the model's and optimizer's ties to the failed world's groups, until re-attached
    _was: Optional[tuple[int, tuple[int, int, int]]] = None  # rank and degrees in the world last left

    def _attempt(self, action: Callable[[], T]) -> tuple[Optional[T], Optional[str]]:
        """``action()``'s result, or the failure (one line) that an in-place recovery must now recover: a
        collective or transfer that failed because a peer died or hung, in the loop, a recovery or the close."""
        try:
            return action(), None
        except RuntimeError as e:
            if not self._recoverable(e):
                raise
            log.debug("in-place recovery of: %s", e)
            return None, str(e).splitlines()[0][:200]  # not the error: its frames hold the old groups

    def _carry_on(self, failure: Optional[str]) -> None:
        """Recover ``failure`` in place; a failure during that recovery (another peer lost in its round,
        restore or replay) starts another round, until one completes or a round cannot (RoundFailed)."""
        while failure is not None:
            _, failure = self._attempt(functools.partial(self._recover_in_place, failure))

    def _recoverable(self, error: RuntimeError) -> bool:
        """Whether ``error`` is recovered in place: only with a membership store and a checkpointer that can
        stop without a collective. A failure that recurs with nobody lost is refused by the round itself
        (:meth:`~megatier.parallel.membership.MembershipRound.decide`), so every survivor ends the same way."""
        if self.membership is None or isinstance(error, DIVERGED) or refusal(error) is not None:
            return False  # a stop or a refusal (RoundFailed too), not a lost peer
        return self._recovering or hasattr(self.checkpointer, "abort")

    def _recover_in_place(self, failure: str) -> None:
        """Re-form the job with the survivors and spares and restore in place: the same layout keeps model,
        optimizer and data; a shrunk one (no spare: recovery.shrink) builds them for the new layout, and a
        survivor whose replica was dropped waits as a spare."""
        self.detected_at = self.detected_at or time.time()
        live = self.step if self._intact and not self._updating else None
        self._recovering, self._updating, self._intact = True, False, False
        if self.ps is not None:  # None: the last round failed before its world formed
            self._leave_world(failure)
        rank, degrees = self._was
        new_rank = self.membership.survive(degrees, self._trainable_dp, self.step)
        if new_rank is None:
            new_rank = self._wait_as_spare()
        become_rank(self.membership, new_rank)
        self.membership.rendezvous(new_rank, self.cfg.parallel.timeout_s)
        self._form_world()
        if (new_rank, self.ps.degrees) == (rank, degrees) and self.model is not None and self._detached is not None:
            attach_groups(self._detached, self.ps)
            self._fit_checkpointing()
            self.checkpointer = self._build_checkpointer(self._factory)
            self.checkpointer.shard.live_version = live
        else:  # another rank or dp: the state is resharded from the checkpoints, as after an elastic relaunch
            log.info("member %s re-forms as rank %d of tp=%d pp=%d dp=%d (was rank %d of dp=%d)",
                     self.membership.me.id, new_rank, *self.ps.degrees, rank, degrees[2])
            if self.grads is not None:
                self.grads.remove_hooks()
            self._build_components()
        self._detached = None
        self._was = (self.ps.rank, self.ps.degrees)
        self.restore()
        self.checkpointer.shard.live_version = None
        self._recovering = False

    def _leave_world(self, failure: str) -> None:
        """Detach the model and optimizer from the failed world's groups, tear them down and stop the
        checkpointer's and the loader's threads without a collective."""
        if self.ps.rank == 0:
            log.warning("step %d: a peer failed (%s); recovering in place (recovery.mode=inprocess)", self.step + 1,
                        failure)
        if self.model is not None:
            holders = [*self.model.modules(), self.optimizer, self.grads, self.nonfinite,
                       *([self.comm] if self.comm is not None else [])]
            self._detached = detach_groups(holders, self.ps)
        self._was = (self.ps.rank, self.ps.degrees)
        dist.destroy_process_group()
        if self.checkpointer is not None:
            self.checkpointer.abort(timeout=min(10.0, self.cfg.parallel.timeout_s))
        if self.batches is not None:  # the read ahead guessed at a step the restore may not go on from
            self.batches.close()
        self.checkpointer = self.ps = None  # the last references: the old groups close, blocked peers fail now
        gc.collect()  # and groups caught in reference cycles (the imports' objects are frozen: megatier.train)

    @property
    def membership_epoch(self) -> int:
        """The membership rounds this process's world came out of (0: the launch's own world)."""
        return self.membership.epoch if self.membership is not None else 0

    def _trainable_dp(self, dp: int) -> bool:
        return trainable_dp(self.cfg, dp)

    def _closed(self, failed: bool) -> tuple[Optional[dict], dict, float]:
        """Drain the checkpointer and take the state's digests (collectives): its status, the digests and the
        drain's seconds. A peer lost meanwhile is recovered in place and the job trains to its end again before
        closing once more; not in a launch that ``failed`` (a diverged step), which just ends."""
        def close() -> tuple[Optional[dict], dict, float]:
            start = time.perf_counter()
            status = self.checkpointer.close(failed=failed) if self.checkpointer is not None else None
            drain_s = time.perf_counter() - start
            return status, {"state_digest": self.state_digest(), "canonical_digest": self.canonical_digest()}, drain_s
        if failed:
            return close()
        out, failure = self._attempt(close)
        while failure is not None:
            self._carry_on(failure)
            self.train()
            out, failure = self._attempt(close)
        return out

    def _wait_as_spare(self) -> int:
        """The round dropped this process's replica: free its training state (rank 0's metrics pass to the new
        rank 0) and wait like a hot spare for a later round's rank; JobEnded when the job needs it no more."""
        log.info("member %s: its data-parallel replica was dropped; waiting as a spare", self.membership.me.id)
        self.logger.close()
        self.logger, self.goodput = NullLogger(), NullLedger()
        self.grads.remove_hooks()
        self.model = self.optimizer = self.grads = self.batches = self.comm = None
        gc.collect()  # and groups caught in reference cycles (the imports' objects are frozen: megatier.train)
        rank = self.membership.await_rank()
        if rank is None:
            raise JobEnded(f"member {self.membership.me.id} was not needed again before the job ended")
        self.detected_at = self.membership.assigned_at
        return rank
