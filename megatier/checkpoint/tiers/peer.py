"""Tier-2: this rank's units replicated into the memory of its ring peer's node.

The same local rank on the next node of the ring (node n -> n+1 mod nodes)
keeps our replica in its node's ``replica/`` area; we keep the replica of the
same local rank on the previous node. Survives a node failure: the lost node's
ranks read their replicas from the survivors.

A lockstep tier: the manager puts each finished unit from the loop's thread one
step after the unit finished, the same step on every rank, and the tick that
follows hands them to the :class:`PeerReplicator`, whose paired transfers run
in a background thread. At restore, the replicas a node holds are listed by
that node and sent over the network to the ranks that need them.

:class:`ReplicaArea` is the read side alone, for a job of one node (no ring):
after a job carries on without a spare node, the lost node's ranks live only
in replica areas of the survivors, and restore must still find them there.
"""
from __future__ import annotations

from typing import Optional

from megatier.checkpoint.format.payload import EncodedPayload
from megatier.checkpoint.format.units import BASE, DIFF, PayloadId
from megatier.checkpoint.reclaim.executor import delete_units
from megatier.checkpoint.reclaim.policy import local_reclaim_set, node_memory_floor, retention_floor
from megatier.checkpoint.tiers.base import NODE, TIER2, Copy, Listing, Tier
from megatier.checkpoint.tiers.local import discard_area, list_area, reclaim_orphans
from megatier.checkpoint.tiers.node_memory import NodeMemory
from megatier.checkpoint.tiers.replicator import PeerReplicator
from megatier.faults import FaultHook, no_faults


class ReplicaArea(Tier):
    """This node's ``replica/`` area as restore sees it: listed by the node, read by the ranks it serves.

    On its own (a job of one node, which has no ring) it saves nothing: it offers what an earlier launch's
    ring left here (the ranks of a node lost without a spare) and, on the node's lister (``lists``), drops it
    once the job's own state is safe (the watermark).
    """

    label, scope, saves = TIER2, NODE, False

    def __init__(self, memory: NodeMemory, *, lists: bool = False, fault: FaultHook = no_faults):
        self.memory = memory
        self.lists = lists
        self.fault = fault

    def where(self) -> str:
        return f"the replica area of {self.memory.node}"

    def put(self, payload: EncodedPayload) -> None:
        raise RuntimeError(f"{self.where()} is read at restore only: a job of one node has no ring to replicate to")

    def list(self) -> Listing:
        return list_area(self.memory, self.label, replica=True)

    def read(self, copy: Copy) -> EncodedPayload:
        return self.memory.load(copy.owner, copy.pid, replica=True)

    def delete(self, pid: PayloadId, owner: Optional[int] = None) -> None:
        for o in ([owner] if owner is not None else self.memory.owners(replica=True)):
            self.memory.delete(o, pid, replica=True)

    def reclaim(self, watermark: Optional[int]) -> None:
        if self.lists:
            reclaim_orphans(self.memory, replica=True, keep=self._writes, watermark=watermark, fault=self.fault)

    def _writes(self, owner: int) -> bool:
        """Whether ``owner``'s replicas here are still being written (by this job's ring)."""
        return False

    def discard_after(self, end: int) -> list[str]:
        return discard_area(self.memory, end, replica=True)


class PeerTier(ReplicaArea):
    """Tier-2 of rank ``rank``: sends to ``replicator.holder``, keeps ``replicator.owner``'s replicas."""

    label, scope, lockstep, takes_steps, saves = TIER2, NODE, True, True, True

    def __init__(self, memory: NodeMemory, replicator: PeerReplicator, *, keep_bases: int = 2,
                 fault: FaultHook = no_faults, lists: bool = False):
        super().__init__(memory, lists=lists, fault=fault)
        self.replicator = replicator
        self.keep_bases = keep_bases
        self._due: dict[str, EncodedPayload] = {}  # put this step, handed over at the tick

    def set_base_interval(self, steps: int) -> None:
        self.replicator.base_interval = steps  # read by the replicator thread when it plans the next base

    def where(self) -> str:
        return f"Tier-2 (rank {self.replicator.holder}, on the next node of the ring)"

    # ---- units -------------------------------------------------------------------------------

    def put(self, payload: EncodedPayload) -> None:
        slot = BASE if payload.stamp.pid.kind == BASE else DIFF  # a step unit travels in the diff slot
        if slot in self._due:
            raise ValueError(f"two {slot} units handed to Tier-2 in one step ({self._due[slot].stamp.pid}, "
                             f"{payload.stamp.pid})")
        self._due[slot] = payload

    # ---- save path ---------------------------------------------------------------------------

    def on_step(self, step: int) -> float:
        due, self._due = self._due, {}
        return self.replicator.on_step(step, diff=due.get(DIFF), base=due.get(BASE))

    def point(self) -> Optional[int]:
        """Newest step the holder has acknowledged: a node failure recovers this rank from there.

        Units are acknowledged in the order they were handed in, one diff batch or step unit per step
        after the first base, so the newest acknowledged one ends the chain."""
        acked = self.replicator.status().acked_units
        if acked.get(BASE) is None:
            return None
        return max(p.version for p in acked.values() if p is not None)

    def reclaim(self, watermark: Optional[int]) -> None:
        owner = self.replicator.owner
        held = [e.pid for e in self.memory.entries(replica=True, owner_rank=owner)]
        below = node_memory_floor(watermark, retention_floor(held, self.keep_bases))
        delete_units(local_reclaim_set(held, below), lambda pid: self.delete(pid, owner), fault=self.fault)
        super().reclaim(watermark)

    def _writes(self, owner: int) -> bool:
        return owner == self.replicator.owner

    def pending_bytes(self) -> int:
        return sum(p.stamp.size for p in self._due.values()) + self.replicator.status().pending_bytes

    def lag_cause(self) -> Optional[str]:
        if self.replicator.status().pending_bytes:
            return "Tier-2 transfers to the ring peer are behind"
        return None

    def drain(self, step: int, timeout: float) -> None:
        self.on_step(step)
        self.replicator.close(timeout)

    def abort(self, timeout: float) -> None:
        self.replicator.abort(timeout)

