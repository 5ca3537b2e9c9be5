"""CheckpointManager: the policy of tiered checkpointing inside the training loop.

The trainer calls three things:

    step = manager.restore()          # once, before the loop: recover or start fresh
    metrics = manager.after_step(s)   # after every optimizer step s
    manager.close()                   # drain the tiers, final commit

What and when (the mechanism lives in the modules it calls):
- every step: the consumed gradient is compressed (in the loop, see after_step)
  and the record goes to the save thread (differential stream); every
  ``diff.batch`` steps the open batch closes;
- at the anchor (0 on a fresh start, E after a recovery) and every
  ``base_interval`` steps after it: a snapshot of the shard goes to the save
  thread (base stream);
- a unit finished for step s is handed to the Tier-2 replicator at step s + 1 on
  every rank, so the ring's transfers pair up deterministically; the replicator
  gets a tick every step to pace base chunks;
- every ``diff.batch`` steps one small all-gather over the control group tells
  every rank the committed base on Tier-3 (the watermark, monotonic) and each
  tier's recovery point; the watermark then drives reclamation everywhere.

The loop never waits on Tier-3. It waits only when a Tier-2 transfer would spill
into the next base (the replicator), when a unit is not serialized by the time
it is handed on, or when payloads awaiting transfer exceed ``memory_budget_gib``;
all of that is ``ckpt_stall_ms``.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import torch
import torch.distributed as dist

from megatier.checkpoint.context import CheckpointContext
from megatier.checkpoint.commit.coordinator import Coordinator
from megatier.checkpoint.format.units import BASE, PayloadId, rank_name
from megatier.checkpoint.tiers.replicator import PeerReplicator
from megatier.checkpoint.reclaim.policy import local_reclaim_set
from megatier.checkpoint.recover.restore import restore as recover
from megatier.checkpoint.shard import ShardAccess
from megatier.checkpoint.save.worker import SaveWorker
from megatier.checkpoint.commit.uploader import Uploader

log = logging.getLogger(__name__)
GC_MID_DELETE = "gc.mid_delete"
_GIB = 1 << 30


class CheckpointManager:
    """Decides what to save and when; one per rank, driven by the training loop in lockstep."""

    def __init__(self, ctx: CheckpointContext, shard: ShardAccess, *, allow_fresh_start: bool = False):
        self.ctx = ctx
        self.shard = shard
        self.allow_fresh_start = allow_fresh_start
        cfg = ctx.cfg
        self.batch = cfg.diff.batch
        self.base_interval = cfg.base_interval
        self.anchor = 0
        self._step = 0
        self._pending_handoff: list[PayloadId] = []
        self.watermark: Optional[int] = None
        self.recovery: Optional[dict] = None
        self._last: dict = {}
        self._reported = {"diff": 0, "base": 0}
        self._budget_warned = 0.0
        self.coordinator = None
        if ctx.remote is not None and ctx.is_coordinator:
            self.coordinator = Coordinator(ctx.remote, ctx.job_id, ctx.world_size, keep_bases=cfg.remote.keep_bases,
                                           fault_hook=ctx.fault)
        self.uploader = None
        if ctx.remote is not None:
            # The coordinator's rank nudges it after each of its own markers (in a world of one, the last).
            self.uploader = Uploader(ctx.remote, ctx.job_id, ctx.rank, incarnation=ctx.incarnation,
                                     fault_hook=ctx.fault,
                                     on_done=None if self.coordinator is None else lambda pid: self.coordinator.nudge())
        self.peer = None
        if ctx.replica_holder_rank is not None and ctx.local is not None:
            self.peer = PeerReplicator(ctx.local, rank=ctx.rank, holder_rank=ctx.replica_holder_rank,
                                       owner_rank=ctx.replica_owner_rank, group=ctx.peer_group,
                                       base_interval=cfg.base_interval,
                                       max_chunk_bytes=int(cfg.peer.max_chunk_mib * (1 << 20)),
                                       timeout_s=ctx.timeout_s, fault_hook=ctx.fault)
        self.worker = SaveWorker(job_id=ctx.job_id, layout=ctx.layout, local=ctx.local,
                                 uploader=self.uploader, keep_for_peer=self.peer is not None)

    # ---- start -----------------------------------------------------------------------------

    def restore(self) -> int:
        """Recover the newest consistent state (or start fresh); returns the step to resume after.

        Must run before the replicator's thread first uses the peer group, i.e.
        before the first after_step; recovery uses that group for its transfers.
        """
        result = recover(self.ctx, self.shard, allow_fresh_start=self.allow_fresh_start)
        start = 0
        if result is not None:
            start = result.end
            self.recovery = result.record
        # Re-base at the resume point: every tier gets a fresh anchor (a replaced node's
        # Tier-1 is empty), and the diff batches that follow are aligned to it.
        self.anchor = start
        self.worker.submit_base(self.shard.capture_base(start))
        self._pending_handoff = [PayloadId.base(start)]
        self._step = start
        return start

    # ---- every step ------------------------------------------------------------------------

    def after_step(self, step: int) -> dict:
        """Save path of step ``step``; returns this step's checkpoint metrics (stall measured by the caller)."""
        ctx = self.ctx
        self._step = step
        if ctx.local is not None:
            # The newest step reached, for "steps lost" after a failure (one tiny atomic file).
            ctx.local.store.put(f"progress/{rank_name(ctx.rank)}", str(step).encode())
        since = step - self.anchor
        # Compressed here, by the loop's own thread team (on a GPU, kernels on the training stream, as in
        # TierCheck): ~1 ms for a few million elements on two cores, where a helper thread doing it
        # alone took twice the CPU and, preempting a member of the team, held the whole step up as long.
        record, nbytes = self.shard.compress(step, *self.shard.consumed(), self.ctx.cfg.diff)
        closes = since % self.batch == 0
        self.worker.submit_diff(record, nbytes, close_batch=closes)
        handoff, self._pending_handoff = self._pending_handoff, []
        if closes:
            self._pending_handoff.append(PayloadId.diff(step - self.batch + 1, step))
        if since % self.base_interval == 0:
            self.worker.submit_base(self.shard.capture_base(step))
            self._pending_handoff.append(PayloadId.base(step))
        stall = self._hand_to_peer(step, handoff)
        stall += self._enforce_budget()
        if since % self.batch == 0:
            self._sync(step)
        return self._metrics(step, stall)

    def _hand_to_peer(self, step: int, pids: list[PayloadId]) -> float:
        """Give the replicator the units finished at step - 1 (every rank, same step) and its pacing tick."""
        if self.peer is None:
            return 0.0
        t0 = time.perf_counter()
        units = {pid.kind: self.worker.take(pid, self.ctx.timeout_s) for pid in pids}
        waited = time.perf_counter() - t0
        return waited + self.peer.on_step(step, diff=units.get("diff"), base=units.get(BASE))

    def _held_bytes(self) -> int:
        held = self.worker.pending_bytes
        if self.uploader is not None:
            held += self.uploader.status().pending_bytes
        if self.peer is not None:
            held += self.peer.status().pending_bytes
        return held

    def _enforce_budget(self) -> float:
        """Block while payloads awaiting transfer exceed the budget; never drop one."""
        budget = self.ctx.cfg.memory_budget_gib * _GIB
        t0 = time.perf_counter()
        while (held := self._held_bytes()) > budget:
            now = time.monotonic()
            if now - self._budget_warned > 30.0:
                self._budget_warned = now
                log.warning("rank %d: %.2f GiB of checkpoint payloads await transfer, over "
                            "checkpoint.memory_budget_gib=%.2f; the loop waits rather than drop data recovery "
                            "needs. Cause: %s", self.ctx.rank, held / _GIB, self.ctx.cfg.memory_budget_gib,
                            self._lag_cause())
            time.sleep(0.05)
        return time.perf_counter() - t0

    def _lag_cause(self) -> str:
        if self.uploader is not None:
            status = self.uploader.status()
            if status.last_error:
                return f"Tier-3 ({self.ctx.remote.url}) is failing: {status.last_error}"
            if status.pending:
                return f"Tier-3 uploads are slower than the save rate ({len(status.pending)} units queued)"
        if self.peer is not None and self.peer.status().pending_bytes:
            return "Tier-2 transfers to the ring peer are behind"
        return "the save thread is behind (CPU starved)"

    # ---- watermark, recovery points, reclamation ----------------------------------------------

    def _t2_point(self) -> Optional[int]:
        if self.peer is None:
            return None
        acked = self.peer.status().acked_units
        base, diff = acked.get(BASE), acked.get("diff")
        if base is None:
            return None
        return max(base.version, diff.last) if diff is not None else base.version

    def _sync(self, step: int) -> None:
        """One all-gather: every rank learns the watermark and every tier's recovery point."""
        ctx = self.ctx
        none = -1
        t3 = newest = None
        if self.coordinator is not None:
            self.coordinator.nudge()  # a batch just closed: its units may be complete soon
            t3, newest = self.coordinator.recovery_point(), self.coordinator.newest_base()
        mine = torch.tensor([v if v is not None else none for v in
                             (self.worker.t1_point(), self._t2_point(), t3, newest)], dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(ctx.world_size)]
        dist.all_gather(rows, mine, group=ctx.control_group)
        table = torch.stack(rows)  # (world, 4): t1, t2, t3 point, newest committed base
        t1, t2 = table[:, 0], table[:, 1]
        t3_point, committed = int(table[0, 2]), int(table[0, 3])
        rack = t3_point if t3_point != none else None

        def worst(per_rank: torch.Tensor) -> Optional[int]:
            # The recovery point of a class is that of its worst rank; a rank may fall back to Tier-3.
            best = torch.maximum(per_rank, torch.full_like(per_rank, t3_point))
            return None if bool((best == none).any()) else int(best.min())

        software = worst(t1) if ctx.local is not None else rack
        # A node failure serves the lost node's ranks from their Tier-2 replicas, the rest from Tier-1.
        node = worst(torch.minimum(t1, t2)) if self.peer is not None else rack
        self._last = {"rpo_software": software, "rpo_node": node, "rpo_rack": rack,
                      "t2_lag_steps": (step - int(t2.min())) if self.peer is not None and int(t2.min()) != none else None,
                      "t3_lag_steps": (step - rack) if rack is not None else None,
                      "tier1_bytes": ctx.local.bytes_held() if ctx.local is not None else 0}
        if committed != none and (self.watermark is None or committed > self.watermark):
            self.watermark = committed
            self._reclaim()

    def _reclaim(self) -> None:
        """Delete Tier-1/Tier-2 units the watermark made obsolete; hand the watermark to the coordinator."""
        ctx, w = self.ctx, self.watermark
        if self.coordinator is not None:
            self.coordinator.set_watermark(w)
        if ctx.local is None:
            return
        areas = [(ctx.rank, False)]
        if self.peer is not None and ctx.replica_owner_rank is not None:
            areas.append((ctx.replica_owner_rank, True))
        for owner, replica in areas:
            held = [e.pid for e in ctx.local.entries(replica=replica, owner_rank=owner)]
            for pid in sorted(local_reclaim_set(held, w), key=lambda p: (p.last, p.kind)):
                ctx.local.delete(owner, pid, replica=replica)
                if not replica:
                    self.worker.forget(pid)
                ctx.fault.hit(GC_MID_DELETE, pid.version)

    # ---- metrics and shutdown ----------------------------------------------------------------

    def _metrics(self, step: int, stall_s: float) -> dict:
        diff_total, base_total = self.worker.diff_bytes, self.worker.base_bytes
        out = {"diff_bytes": diff_total - self._reported["diff"], "base_bytes": base_total - self._reported["base"],
               "watermark": self.watermark, "ckpt_wait_ms": 1000.0 * stall_s}
        self._reported = {"diff": diff_total, "base": base_total}
        out.update(self._last)
        return out

    def close(self, timeout: Optional[float] = None) -> None:
        """Drain: finish serializing, hand the last units to the peer, upload, final commit."""
        ctx = self.ctx
        timeout = timeout if timeout is not None else ctx.timeout_s
        self.worker.flush(timeout)
        if self.peer is not None:
            # Same step on every rank, so the ring's final transfers pair up.
            self._hand_to_peer(self._step + 1, self._pending_handoff)
            self._pending_handoff = []
            self.peer.close(timeout)
        self.worker.close(timeout)
        if self.uploader is not None:
            left = self.uploader.close(timeout)
            if left:
                log.warning("rank %d: %d units not uploaded to Tier-3 at exit: %s", ctx.rank, len(left),
                            ", ".join(map(str, left)))
        # Every rank's markers are written before the coordinator's final commit round.
        dist.barrier(group=ctx.control_group)
        if self.coordinator is not None:
            self.coordinator.close(timeout)
