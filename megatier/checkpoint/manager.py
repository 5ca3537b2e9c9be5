"""CheckpointManager: the policy of tiered checkpointing inside the training loop.

The trainer calls three things (the :class:`~megatier.checkpoint.checkpointer.Checkpointer` protocol):

    step, record = manager.restore()   # once, before the loop: recover or start fresh
    metrics = manager.after_step(s)     # after every optimizer step s
    manager.close()                     # drain the tiers, final commit

What and when (the tiers move the bytes, see :mod:`.tiers.base`):
- every step: the consumed gradient is compressed (in the loop, see after_step)
  and the record goes to the save thread (differential stream); every
  ``diff.batch`` steps the open batch closes; with ``diff.per_step`` the
  loop also writes the record of every other step as a step unit of its own,
  on Tier-1 before after_step returns and to Tier-2 at the next tick, so a
  failure loses at most the step in flight (two for a node failure), not the
  open batch (the save thread may lag the loop when the cores are saturated;
  the step unit must not);
- at the anchor (0 on a fresh start, E after a recovery) and every
  ``base_interval`` steps after it: a snapshot of the shard goes to the save
  thread (base stream; Tier-3 gets the anchor and every ``remote.base_every``-th
  base after it, see :mod:`.cadence`); with ``base_capture=spread`` the bases after the
  anchor are copied in ``capture_steps`` parts over the steps ending at their
  version and reconciled by replay, the parts placed into the next step's
  operations by a Checkflow schedule (:mod:`.save.base_capture`);
- the save thread puts each finished unit into the tiers that take units from
  it; a unit finished for step s is put into the lockstep tiers (Tier-2) at
  step s + 1 on every rank, so the ring's transfers pair up deterministically;
  every tier gets a tick every step (Tier-1 records progress, Tier-2 paces);
- every ``diff.batch`` steps one small all-gather tells every rank each tier's
  recovery point and the newest base committed on the durable tier (the
  watermark, monotonic); the watermark then drives reclamation in every tier.

The loop never waits on Tier-3. It waits only when a Tier-2 transfer would spill
into the next base, when a unit is not serialized by the time it is handed on,
or when payloads awaiting transfer exceed ``memory_budget_gib``; all of that is
``ckpt_stall_ms``.
"""
from __future__ import annotations

import logging
import time
from typing import Optional, Union

from torch import nn

from megatier.checkpoint.context import CheckpointContext
from megatier.checkpoint.format.payload import DiffStep, EncodedPayload, draft_diff_batch
from megatier.checkpoint.format.units import BASE, DIFF, STEP, PayloadId
from megatier.checkpoint.health import TierHealth, final_status
from megatier.checkpoint.policy import replicas
from megatier.checkpoint.policy.auto_interval import CostMeter, decide, initial_interval, replay_seconds_per_step
from megatier.checkpoint.recover.loops import closed
from megatier.checkpoint.recover.restore import RecoveryResult
from megatier.checkpoint.recover.restore import restore as recover
from megatier.checkpoint.save.base_capture import BaseCapturer
from megatier.checkpoint.save.clock import PhaseClock
from megatier.checkpoint.save.worker import SaveWorker
from megatier.checkpoint.shard import ShardAccess
from megatier.checkpoint.tiers.base import TIER1
from megatier.checkpoint.tiers.durable import save_thread_tiers
from megatier.checkpoint.watermark import WatermarkSync

log = logging.getLogger(__name__)
_GIB = 1 << 30


class CheckpointManager:
    """Decides what to save and when; one per rank, driven by the training loop in lockstep."""

    def __init__(self, ctx: CheckpointContext, shard: ShardAccess, *, model: Optional[nn.Module] = None,
                 inline: bool = False):
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.shard = shard
        self.anchor = 0
        self._step = 0
        self._last_base: Optional[int] = None  # the version of the newest base handed to the save thread
        # Units finished at the previous step, for the lockstep tiers: the save thread's (by id) or the loop's own.
        self._handoff: list[Union[PayloadId, EncodedPayload]] = []
        self._restored: Optional[RecoveryResult] = None  # its restore history is marked clean at a clean close
        self._withhold_next = False  # the replica check failed: the next base is kept from Tier-3
        saving = [t for t in ctx.tiers if t.saves]
        self._lockstep = [t for t in saving if t.lockstep]
        self.watermark: Optional[int] = None
        self.syncs = WatermarkSync(ctx.comm, ctx.tiers)
        memory = next((getattr(t, "memory", None) for t in ctx.tiers if t.label == TIER1 and t.saves), None)
        stage = memory.capture_area(ctx.rank) if memory is not None and model is not None else None
        self.capture = BaseCapturer(self.cfg, shard, model, rank=ctx.rank, stage=stage)  # model: the schedule
        self._auto: Optional[CostMeter] = None  # base_interval=auto until its decision
        self._once: dict = {}  # figures for the next step's record only
        self._last: dict = {}
        self._reported = {"diff": 0, "base": 0}
        self._budget_warned = 0.0
        self.health = TierHealth(ctx)
        self._step_tiers = [t for t in saving if t.takes_steps] if self.cfg.diff.per_step else []
        # Tier-3 gets every remote.base_every-th base from the anchor, every other unit as it comes
        # (policy/cadence.py).
        worker_tiers = save_thread_tiers([t for t in saving if not t.lockstep],
                                         base_interval=initial_interval(self.cfg),
                                         base_every=self.cfg.remote.base_every, anchor=lambda: self.anchor,
                                         withholds=ctx.reliability.replica_check_interval > 0)
        self.worker = SaveWorker(job_id=ctx.job_id, layout=ctx.layout, tiers=worker_tiers,
                                 keep_for_loop=bool(self._lockstep), fingerprint=ctx.fingerprint_id, inline=inline)

    # ---- start -------------------------------------------------------------------------------

    def restore(self) -> tuple[int, Optional[dict]]:
        """Recover the newest consistent state (or start fresh): (the step the state is at, the recovery record).

        Must run before the first after_step: recovery uses the transfer group
        that the Tier-2 replicator's thread takes over from its first tick.
        """
        try:
            result = recover(self.ctx, self.shard, allow_fresh_start=self.cfg.allow_fresh_start)
        except BaseException:
            self.ctx.close()  # this launch will write nothing: stop the tiers, give up the Tier-3 lease
            raise
        start, record = (result.end, result.record) if result is not None else (self.shard.start_step, None)
        self._restored = result
        if result is not None and result.adopted:
            self._follow_job(result.adopted)
        for tier in self.ctx.tiers:
            tier.record_config(self.ctx.fingerprint_id, self.ctx.fingerprint)
            tier.start()
        self._repair(record["quarantined"] if record else [])
        # Re-base at the resume point: every tier gets a fresh anchor (a replaced node's
        # Tier-1 is empty), and the diff batches that follow are aligned to it.
        self.anchor = self.capture.anchor = start
        if self.cfg.base_interval == "auto":
            self._auto = CostMeter(self.cfg, start)
        started = time.perf_counter()
        self.worker.submit_base(self.shard.capture_base(start))
        if self._auto is not None:
            self._auto.anchor_capture_s = time.perf_counter() - started
        self._handoff = [PayloadId.base(start)]
        self._step = self._last_base = start
        if result is not None and result.durable_base is not None:
            # What the first watermark sync would learn, at once: a job whose launches all end before a sync
            # completes would otherwise never reclaim Tier-3, and its listing (every restore's) would grow.
            self.watermark = result.durable_base
            self.worker.submit_reclaim(self.watermark, self.ctx.tiers)
        return start, record

    def _follow_job(self, recorded: dict[str, str]) -> None:
        """Take the job's recorded values of the keys this launch follows (an unset LR decay horizon, or the whole
        schedule with optim.use_checkpoint_scheduler): into the optimizer's schedule and the fingerprint its new
        units carry."""
        self.ctx.adopt(recorded)
        self.worker.fingerprint = self.ctx.fingerprint_id
        self.shard.follow_schedule(recorded)

    def _repair(self, quarantined: list[str]) -> None:
        """Offer every tier this rank's surviving copy of each unit restore quarantined (a tier that set one
        aside stores it again; once every rank's copy is back, Tier-3 commits it anew)."""
        for name in quarantined:
            pid = PayloadId.parse(name)
            payload = next((p for t in self.ctx.tiers if (p := t.own_copy(pid)) is not None), None)
            if payload is None:
                log.warning("rank %d has no surviving copy of quarantined %s to re-upload", self.ctx.rank, pid)
                continue
            for tier in self.ctx.tiers:
                tier.repair(payload)

    # ---- every step --------------------------------------------------------------------------

    def after_step(self, step: int) -> dict:
        """Save path of step ``step``; returns this step's checkpoint metrics, with the milliseconds each part
        of the save path held the loop (``ckpt_<part>_ms``; the whole stall is measured by the caller).

        The compression and the step unit's write run with the other threads of the loop's OpenMP team asleep
        (:func:`~megatier.ops.run_with_team_parked`): an idle team thread otherwise spins through them and
        burns a second core. The compression goes outside when ``checkpoint.diff.threads`` asks for the team;
        the base capture's copies may use the team; and the rest wakes the helper threads, which then hold the
        free core, so a team parked through that part would wait for a core to leave its region."""
        self._step = step
        if self._auto is not None:
            self._auto.step_done()
        clock = PhaseClock()
        odd = self._check_replicas(step)
        clock.lap("replicas")
        closes = (step - self.anchor) % self.cfg.diff.batch == 0
        if self.cfg.diff.threads == 1:
            record, nbytes, handoff = clock.parked(
                lambda: self._save_diff(step, self._compress(step, clock), closes, clock))
        else:
            compressed = self._compress(step, clock)
            record, nbytes, handoff = clock.parked(lambda: self._save_diff(step, compressed, closes, clock))
        base = self.capture.after_step(step)
        clock.lap("base_copy")
        self._hand_on(step, record, nbytes, closes, handoff, base, clock)
        metrics = self._metrics(clock.laps)
        if odd:
            metrics["replica_mismatch"] = odd
        return metrics

    def _check_replicas(self, step: int) -> list[int]:
        """The replica check of ``step`` when due (:mod:`.policy.replicas`): the ranks whose parameters differ
        from their data-parallel group's; a mismatch keeps the base of the interval from Tier-3."""
        if self.ctx.layout.dp == 1 or not replicas.due(step, self.ctx.reliability.replica_check_interval):
            return []  # without data parallelism there are no replicas to compare
        odd = replicas.odd_replicas(self.shard.replica_digests())
        if odd:
            self._withhold_next = True
            self.shard.publish()  # gathered afresh from the optimizer's shards before the next step uses them
            healed = not replicas.odd_replicas(self.shard.replica_digests())
            log.warning("step %d: the parameters of data-parallel replica(s) %s differed from their group's after "
                        "the all-gather (silent data corruption?); %s; the base of this interval is kept from Tier-3",
                        step, odd, "gathered again, they agree" if healed else "gathered again, they STILL differ")
        return odd

    def _compress(self, step: int, clock: PhaseClock) -> tuple[DiffStep, int]:
        # Compressed here, in the loop (on a GPU, kernels on the training stream, as in TierCheck), by
        # checkpoint.diff.threads of its CPU threads. A helper thread doing it costs more CPU and, preempting a
        # member of the loop's team, holds the whole step up: the team waits at each parallel pass's barrier
        # for a preempted member.
        out = self.shard.compress(step, *self.shard.consumed(), self.cfg.diff)
        clock.lap("compress")
        return out

    def _save_diff(self, step: int, compressed: tuple[DiffStep, int], closes: bool,
                   clock: PhaseClock) -> tuple[DiffStep, int, list[Union[PayloadId, EncodedPayload]]]:
        """This step's record into Tier-1 as a step unit (or its batch's id, when the record closes it, for the
        next step's hand-over); returns the record, its bytes and the units the previous step finished."""
        record, nbytes = compressed
        handoff, self._handoff = self._handoff, []
        if closes:
            self._handoff.append(PayloadId.diff(step - self.cfg.diff.batch + 1, step))
        elif self._step_tiers:
            self._save_step_unit(record)
        clock.lap("step_unit")
        return record, nbytes, handoff

    def _hand_on(self, step: int, record: DiffStep, nbytes: int, closes: bool,
                 handoff: list[Union[PayloadId, EncodedPayload]], base, clock: PhaseClock) -> None:
        """The rest of the step's save path, after the base capture: hand-over, ticks, submits, sync, budget (not
        parked: see :meth:`after_step`)."""
        if base is not None:
            self._handoff.append(PayloadId.base(base.version))
            self._last_base = base.version
            if self._withhold_next:  # before the save thread gets it
                for tier in self.worker.tiers:
                    tier.withhold(base.version)
                self._withhold_next = False
        self._hand_over(handoff)
        clock.lap("handover")
        # The helper threads are woken last (the replicator, the save thread, the capture's copier, the sync's
        # gather): a woken helper takes the GIL whenever the loop lets go of it (any write, any native call) and
        # keeps it until it blocks or the switch interval (5 ms) runs out, so a helper woken early would make
        # each later part here wait.
        for tier in self.ctx.tiers:  # every rank at the same step: Tier-2's ring transfers pair up
            tier.on_step(step)
        clock.lap("tick")
        self.worker.submit_diff(record, nbytes, close_batch=closes)
        if base is not None:
            self.worker.submit_base(base)
        self.capture.release()
        clock.lap("submit")
        if self._auto is not None and step == self._auto.decide_at:
            self._choose_interval()
        if closes:  # after the submits: a unit the save thread stores at once (inline) counts in this sync
            self._sync(step)
        clock.lap("sync")
        self._enforce_budget()
        clock.lap("budget")

    def _choose_interval(self) -> None:
        """base_interval=auto at the end of its warm-up: every rank's costs gathered, the same interval taken by
        all (:mod:`.auto_interval`); a one-time stall (the save thread drains so the anchor base's time is known)."""
        self._absorb_syncs(block=True)  # no other collective of the comm in flight
        self.worker.flush(self.ctx.timeout_s)
        o = self.shard.optimizer
        mine = self._auto.figures(save_thread_base_s=self.worker.base_seconds[0] if self.worker.base_seconds else 0.0,
                                  upload_s=self._tier_metric("t3_base_upload_s"), node=self.ctx.node,
                                  replay_s=replay_seconds_per_step(o.master, o.cfg, o.decay_ranges))
        choice, costs, mtbf = decide(self.cfg, self.ctx.comm.gather(mine, what="the base interval decision"))
        self._auto = None
        self.capture.interval = choice.interval
        for tier in [*self.ctx.tiers, *self.worker.tiers]:
            tier.set_base_interval(choice.interval)
        self._once = {"base_interval": choice.interval, "base_interval_goodput": choice.goodput}
        if self.ctx.rank == 0:
            log.info("%s", choice.describe(costs, mtbf))

    def _tier_metric(self, key: str):
        """A tier's metric now (the loop's own reading, for a one-time decision), None if no tier has it."""
        return next((m[key] for t in self.ctx.tiers if key in (m := t.metrics())), None)

    def _save_step_unit(self, record) -> None:
        """Write this step's record as a step unit into Tier-1 now (a write to node memory) and keep
        it for the lockstep tiers' next tick."""
        draft = draft_diff_batch([record], job_id=self.ctx.job_id, layout=self.ctx.layout,
                                 fingerprint=self.ctx.fingerprint_id, step_unit=True)
        own = [t for t in self._step_tiers if not t.lockstep]
        payload = own[0].put_draft(draft) if own else draft.to_payload()
        if any(t.lockstep for t in self._step_tiers):
            self._handoff.append(payload)

    def _hand_over(self, units: list[Union[PayloadId, EncodedPayload]]) -> None:
        """Put the units finished at the previous step into the lockstep tiers (waits for the save thread to
        finish encoding any that it still has). Without a lockstep tier, wait for the save thread to have stored
        the batch the previous step closed: that step's record is in no step unit, so until its batch is on
        Tier-1 a crash would lose it and every step after it (the bound of one step lost must not depend on a
        helper thread keeping up with a loaded machine; the wait is part of ckpt_stall_ms)."""
        if not self._lockstep:
            for unit in units:
                if isinstance(unit, PayloadId) and unit.kind == DIFF:
                    self.worker.wait_stored(unit, self.ctx.timeout_s)
            return
        for unit in units:
            payload = unit if isinstance(unit, EncodedPayload) else self.worker.take(unit, self.ctx.timeout_s)
            for tier in self._lockstep:
                if payload.stamp.pid.kind != STEP or tier.takes_steps:
                    tier.put(payload)

    def _held_bytes(self) -> int:
        return self.worker.pending_bytes + sum(t.pending_bytes() for t in self.ctx.tiers)

    def _enforce_budget(self) -> None:
        """Block while payloads awaiting transfer exceed the budget; never drop one."""
        budget = self.cfg.memory_budget_gib * _GIB
        while (held := self._held_bytes()) > budget:
            now = time.monotonic()
            if now - self._budget_warned > 30.0:
                self._budget_warned = now
                causes = [c for t in reversed(self.ctx.tiers) if (c := t.lag_cause())]
                log.warning("rank %d: %.2f GiB of checkpoint payloads await transfer, over "
                            "checkpoint.memory_budget_gib=%.2f; the loop waits rather than drop data recovery "
                            "needs. Cause: %s", self.ctx.rank, held / _GIB, self.cfg.memory_budget_gib,
                            causes[0] if causes else "the save thread is behind (CPU starved)")
            time.sleep(0.05)

    # ---- watermark, recovery points, reclamation ---------------------------------------------

    def _sync(self, step: int) -> None:
        """Start this batch end's watermark sync (:mod:`megatier.checkpoint.watermark`) and use those done."""
        self.syncs.start(step)
        self._absorb_syncs(block=False)
        self._last["degraded"] = self.health.degraded()

    def _absorb_syncs(self, block: bool) -> None:
        if not self.syncs.absorb(block):
            return
        self._last = {**self.syncs.points, **self.worker.tier_metrics}  # the save thread's, after its last reclaim
        committed = self.syncs.committed
        if committed is not None and (self.watermark is None or committed > self.watermark):
            self.watermark = committed
        # Node memory also keeps to its own retention while Tier-3 is behind; the save thread deletes.
        self.worker.submit_reclaim(self.watermark, self.ctx.tiers)

    # ---- metrics and shutdown ----------------------------------------------------------------

    def _metrics(self, laps: dict) -> dict:
        diff_total, base_total = self.worker.diff_bytes, self.worker.base_bytes
        out = {"diff_bytes": diff_total - self._reported["diff"], "base_bytes": base_total - self._reported["base"],
               "watermark": self.watermark, **{f"ckpt_{part}_ms": ms for part, ms in laps.items()}}
        self._reported = {"diff": diff_total, "base": base_total}
        out.update(self._last)
        out.update(self.capture.metrics())
        out.update(self._once)
        self._once = {}
        if self.shard.inexact_since is not None:  # a last-resort recovery rebuilt a stage: not the exact run
            out["inexact_since"] = self.shard.inexact_since
        return out

    def close(self, timeout: Optional[float] = None, *, failed: bool = False) -> dict:
        """Drain: finish serializing, hand the last units over, move them, final commit (collective).

        Tier-3 gets at most ``checkpoint.remote.drain_timeout_s``; returns the final status (:func:`~megatier.
        checkpoint.health.final_status`), which says loudly when Tier-3 stayed behind. Unless the launch ``failed``,
        the restore it started from is marked clean in the job's restore history (megatier.checkpoint.recover.loops).
        """
        timeout = timeout if timeout is not None else self.ctx.timeout_s
        self._absorb_syncs(block=True)  # before any other collective of the comm
        base = self.capture.flush()
        if base is not None:
            self._submit_base(base)
        self.capture.close()
        self._close_open_batch()
        if self.cfg.final_base and self._step > self.anchor and self._last_base != self._step:
            self._submit_base(self.shard.capture_base(self._step), final=True)
        self.worker.flush(timeout)
        # Same step on every rank, so the ring's final transfers pair up.
        self._hand_over(self._handoff)
        self._handoff = []
        for tier in self.ctx.tiers:
            tier.drain(self._step + 1, timeout)
        self.worker.close(timeout)
        # Every rank's units are out (Tier-3: markers written) before the final commit round.
        self.ctx.comm.barrier(what=f"the checkpoint drain at exit (after step {self._step})")
        if self._restored is not None and not failed:
            for tier in self._restored.keeps_history:
                tier.record_restores(closed(self._restored.history))
        for tier in self.ctx.tiers:
            tier.close(timeout)
        return final_status(self.ctx, self._step)  # close() ended the open batch at the last step

    def abort(self, timeout: float) -> None:
        """The job's world broke mid-run (in-process recovery): stop every helper thread without a collective.
        The save thread stores what it holds (node memory keeps it as a recovery source), the tiers stop
        theirs (:meth:`Tier.abort`); gathers in flight are dropped with their process group. The manager
        cannot be used afterwards: the re-formed job builds a new one."""
        self.syncs.drop()
        self.ctx.comm.abandon()
        self.capture.close()
        try:
            self.worker.close(timeout)
        except Exception as e:  # a failed save thread: what it stored stays, the rest is in no tier
            log.warning("rank %d: the save thread stopped with an error while recovering: %s", self.ctx.rank, e)
        for tier in self.ctx.tiers:
            try:
                tier.abort(timeout)
            except Exception as e:
                log.warning("rank %d: %s did not stop cleanly while recovering: %s", self.ctx.rank, tier.where(), e)

    def _submit_base(self, base, *, final: bool = False) -> None:
        """At exit: hand a base to the save thread, and to the lockstep tiers with the last hand-over; a
        ``final`` one goes to Tier-3 whatever ``remote.base_every`` skips, so the last step is exact there too."""
        if final:
            for tier in self.worker.tiers:
                tier.upload_always(base.version)
            # A lockstep tier takes one base per step, and this one supersedes a base still waiting for its
            # hand-over (the capture's, handed on at the last step); the save thread still stores that one.
            self._handoff = [u for u in self._handoff if not (isinstance(u, PayloadId) and u.kind == BASE)]
        self.worker.submit_base(base)
        self._handoff.append(PayloadId.base(base.version))
        self._last_base = base.version

    def _close_open_batch(self) -> None:
        """At exit: the steps of the open diff batch become a (shorter) batch of their own, so every tier,
        Tier-3 included, ends at the last step rather than at the last full batch."""
        open_steps = (self._step - self.anchor) % self.cfg.diff.batch
        if open_steps:
            self.worker.submit_close_batch()
            batch = PayloadId.diff(self._step - open_steps + 1, self._step)
            # The batch covers the step units still waiting for their hand-over: a lockstep tier takes one diff
            # unit per step, and the batch alone holds every one of those records.
            self._handoff = [u for u in self._handoff if not (
                isinstance(u, EncodedPayload) and u.stamp.pid.kind == STEP and batch.first <= u.stamp.pid.last)]
            self._handoff.append(batch)
