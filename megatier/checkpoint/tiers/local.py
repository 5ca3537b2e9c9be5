"""Tier-1: this rank's units in its node's memory (``own/rank<R>/`` of :class:`NodeMemory`).

Survives a software failure: the process dies, the node's memory (files under
/dev/shm) does not. Being the cheapest tier it is first in the list, so the
save thread serializes every payload straight into its Tier-1 file
(:meth:`LocalTier.put_draft`) and the other tiers are offered a read-only map
of that file: one copy of the tensors feeds all three tiers.

It also keeps the rank's progress key (the newest step reached, for "steps
lost" after a failure), rewritten at every step's tick.

A full or failing node memory never stops training: a unit it cannot store is
still serialized (to bytes) for the other tiers, the tier reports itself
degraded, and it is tried again with the next unit.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional, Sequence

from megatier.checkpoint.format.chain import chain_end
from megatier.checkpoint.format.payload import EncodedPayload, PayloadDraft, PayloadError
from megatier.checkpoint.format.units import BASE, DIFF, PayloadId
from megatier.checkpoint.reclaim.executor import delete_units
from megatier.checkpoint.reclaim.policy import beyond_end, local_reclaim_set, node_memory_floor, retention_floor
from megatier.checkpoint.storage.store import ObjectNotFound, StoreError
from megatier.checkpoint.tiers.base import NODE, TIER1, Copy, Listing, Tier
from megatier.checkpoint.tiers.node_memory import NodeMemory
from megatier.faults import FaultHook, no_faults

log = logging.getLogger(__name__)


def list_area(memory: NodeMemory, label: str, *, replica: bool) -> Listing:
    """Every owner's complete units in one kind of area of ``memory`` (own: Tier-1, replica: Tier-2)."""
    entries = memory.entries(replica=replica)
    copies = [Copy(s, label, memory.node) for s in memory.list(replica=replica)]
    torn = [e for e in entries if not e.complete]
    notes = [f"{memory.node} {'replica' if replica else 'own'} area: {e.pid} of rank {e.owner_rank} is incomplete "
             f"(its write was cut short), ignored" for e in torn]
    return Listing(copies=copies, traces=bool(entries), incomplete=len(torn), notes=notes)


def discard_area(memory: NodeMemory, end: int, *, replica: bool) -> list[str]:
    """Sweep crashed writers' leftovers in every area of one kind and delete units after ``end``."""
    gone = []
    kind = "replica" if replica else "own"
    for owner in memory.owners(replica=replica):
        memory.sweep_incomplete(owner, replica=replica)
        held = [e.pid for e in memory.entries(replica=replica, owner_rank=owner)]
        def delete(pid: PayloadId, owner: int = owner) -> None:
            memory.delete(owner, pid, replica=replica)

        for pid in delete_units(beyond_end(held, end), delete):
            gone.append(f"{memory.node} {kind} rank {owner} {pid}")
    return gone


def reclaim_orphans(memory: NodeMemory, *, replica: bool, keep: Callable[[int], bool], watermark: Optional[int],
                    fault: FaultHook = no_faults) -> None:
    """Delete what the watermark makes obsolete in the areas of owners that no longer write here (``keep(owner)``
    False): ranks of an older, larger layout, or ring owners of an older ring, after a resharded restore. Nobody
    else would ever delete them; run by one rank per node (the lister)."""
    if watermark is None:
        return
    for owner in memory.owners(replica=replica):
        if keep(owner):
            continue
        held = [e.pid for e in memory.entries(replica=replica, owner_rank=owner)]

        def delete(pid: PayloadId, owner: int = owner) -> None:
            memory.delete(owner, pid, replica=replica)

        delete_units(local_reclaim_set(held, watermark), delete, fault=fault)


class LocalTier(Tier):
    """Tier-1 of rank ``rank``: its own area in ``memory``, this node's."""

    label, scope, takes_steps = TIER1, NODE, True

    def __init__(self, memory: NodeMemory, rank: int, *, keep_bases: int = 2, budget_bytes: int = 0,
                 fault: FaultHook = no_faults, world_size: Optional[int] = None, other_names: Sequence[str] = ()):
        self.memory = memory
        # Node areas of this job under other node names that no node adopted (:mod:`.adoption`): traces of the
        # job, so a launch that finds nothing else refuses to start fresh over them.
        self.other_names = tuple(other_names)
        self.rank = rank
        # On the node's lister only: the job's world, whose ranks own areas; areas of ranks beyond it (an older,
        # larger layout's) are reclaimed here.
        self.world_size = world_size
        self.keep_bases, self.budget_bytes = keep_bases, budget_bytes
        self.fault = fault
        # Why the last write of each kind ("units", "progress") failed; a kind's next success clears it. The
        # loop and the save thread both write, so one kind's success must not hide the other's failure.
        self._problems: dict[str, str] = {}
        self._lock = threading.Lock()
        # Units this launch wrote and still holds: the Tier-1 recovery point (read by the loop's thread).
        self._bases: set[int] = set()
        self._diffs: set[PayloadId] = set()

    def where(self) -> str:
        return f"Tier-1 on {self.memory.node}"

    # ---- units -------------------------------------------------------------------------------

    def put(self, payload: EncodedPayload) -> None:
        try:
            self.memory.save(payload)
        except (StoreError, OSError) as e:
            self._problems["units"] = f"{self.where()} cannot store {payload.stamp.pid}: {e}"
            return
        self._problems.pop("units", None)
        self._held(payload.stamp.pid, True)

    def put_draft(self, draft: PayloadDraft) -> EncodedPayload:
        try:
            payload = self.memory.save_draft(draft)
        except (StoreError, OSError) as e:  # full or failing: the other tiers still get the unit
            self._problems["units"] = f"{self.where()} cannot store {draft.pid}: {e}"
            return draft.to_payload()
        self._problems.pop("units", None)
        self._held(draft.pid, True)
        return payload

    def list(self) -> Listing:
        listing = list_area(self.memory, self.label, replica=False)
        listing.progress = self.memory.read_progress()
        listing.fingerprints = self.memory.read_fingerprints()
        listing.restores = self.memory.read_restores()
        listing.traces = listing.traces or bool(listing.progress) or bool(self.other_names)
        return listing

    def read(self, copy: Copy) -> EncodedPayload:
        return self.memory.load(copy.owner, copy.pid, replica=False)

    def own_copy(self, pid: PayloadId) -> Optional[EncodedPayload]:
        try:
            return self.memory.load(self.rank, pid)
        except (ObjectNotFound, PayloadError):
            return None

    def delete(self, pid: PayloadId, owner: Optional[int] = None) -> None:
        for o in ([owner] if owner is not None else self.memory.owners(replica=False)):
            self.memory.delete(o, pid)
            if o == self.rank:
                self._held(pid, False)

    def _held(self, pid: PayloadId, present: bool) -> None:
        with self._lock:
            group = self._bases if pid.kind == BASE else self._diffs
            key = pid.version if pid.kind == BASE else pid
            (group.add if present else group.discard)(key)
            if present and pid.kind == DIFF:  # node memory dropped the step units the batch covers
                self._diffs.difference_update(PayloadId.step(s) for s in range(pid.first, pid.last + 1))

    # ---- save path ---------------------------------------------------------------------------

    def record_config(self, fingerprint_id: str, fingerprint: dict) -> None:
        if fingerprint_id:
            self.memory.write_fingerprint(fingerprint_id, fingerprint)

    def record_restores(self, history: list[dict]) -> None:
        try:
            self.memory.write_restores(history)
        except (StoreError, OSError) as e:
            log.warning("%s cannot keep the restore history: %s", self.where(), e)

    def on_step(self, step: int) -> float:
        try:
            self.memory.write_progress(self.rank, step)
        except (StoreError, OSError) as e:
            self._problems["progress"] = f"{self.where()} cannot record progress: {e}"
        else:
            self._problems.pop("progress", None)
        return 0.0

    def degraded(self) -> Optional[str]:
        problems = dict(self._problems)  # a copy: the save thread may update it meanwhile
        if not problems and self.budget_bytes and self.memory.bytes_held() > self.budget_bytes:
            return (f"{self.where()} holds {self.memory.bytes_held() / 2**30:.2f} GiB, over "
                    f"checkpoint.local.budget_gib={self.budget_bytes / 2**30:.2f}")
        return "; ".join(problems[k] for k in sorted(problems)) or None

    def point(self) -> Optional[int]:
        with self._lock:
            return chain_end(set(self._bases), set(self._diffs))

    def reclaim(self, watermark: Optional[int]) -> None:
        held = [e.pid for e in self.memory.entries(replica=False, owner_rank=self.rank)]
        keep = self.keep_bases
        if self.budget_bytes and self.memory.bytes_held() > self.budget_bytes:
            self.memory.release_spares()
            if self.memory.bytes_held() > self.budget_bytes:
                keep = 1  # over budget: only the newest base and its chain
        below = node_memory_floor(watermark, retention_floor(held, keep))
        delete_units(local_reclaim_set(held, below), lambda pid: self.delete(pid, self.rank), fault=self.fault)
        if self.world_size is not None:
            world = self.world_size
            reclaim_orphans(self.memory, replica=False, keep=lambda o: o < world, watermark=watermark,
                            fault=self.fault)

    def metrics(self) -> dict:
        return {"tier1_bytes": self.memory.bytes_held()}

    def close(self, timeout: float) -> None:
        self.memory.release_spares(for_good=True)

    # ---- recovery ----------------------------------------------------------------------------

    def discard_after(self, end: int) -> list[str]:
        gone = discard_area(self.memory, end, replica=False)
        self.memory.clear_progress()
        return gone
