"""The Tier interface: what the save path and the recovery path do with every tier.

The manager and recovery hold the job's tiers as one list, cheapest first
(Tier-1 node memory, Tier-2 the ring peer's memory, Tier-3 remote storage);
the recovery cascade tries copies in that order. Each tier implements four
operations on units (a base, a diff batch or a step unit of one rank):

    put(payload)        take a finished unit (the save thread calls it, in unit order)
    list()              what this tier holds, as Copies (the inventory at restore)
    read(copy)          the bytes of a copy this rank can reach directly, checksum-verified
    delete(pid, owner)  remove owner's copy of a unit (every rank's when owner is None)

and a few hooks with neutral defaults: a per-step tick on the loop's thread,
the tier's recovery point, reclamation behind the watermark, held bytes for
the memory budget, draining at close.

Who calls ``put``: the save thread, as soon as a unit is serialized, for most
tiers. A *lockstep* tier (Tier-2, whose transfers pair up across ranks) gets
each unit from the loop's thread instead, one step after the unit finished,
at the same step on every rank.

Step units (one step's record while its batch is open) go only to tiers that
take them (``takes_steps``: node memory, Tier-1 and Tier-2); Tier-3 stores
whole batches, its unit of upload and commit.

Scope says who lists a tier at restore: a ``NODE`` tier is one node's memory,
the same for every rank on the node, so the node's lowest rank (its *server*)
lists it and serves its copies to ranks on other nodes; a ``JOB`` tier
(Tier-3) is one store for the whole job, listed once by rank 0 and read by one
*leader* per node.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Optional

from megatier.checkpoint.format.payload import EncodedPayload, PayloadDraft, Stamp
from megatier.checkpoint.format.units import PayloadId

TIER1, TIER2, TIER3 = "tier1", "tier2", "tier3"
TIER_ORDER = (TIER1, TIER2, TIER3)  # cheapest first: the recovery cascade
NODE, JOB = "node", "job"


@dataclass(frozen=True)
class Copy:
    """One complete copy of a rank's unit, as a tier listed it.

    ``tier`` is the label of the tier that holds (and reads) it; ``node`` the
    node whose memory holds it, None for remote storage.
    """

    stamp: Stamp
    tier: str
    node: Optional[str]

    @property
    def owner(self) -> int:
        return self.stamp.rank

    @property
    def pid(self) -> PayloadId:
        return self.stamp.pid

    @property
    def replica(self) -> bool:
        return self.tier == TIER2

    def reach(self, node: str) -> str:
        """How a rank on ``node`` gets this copy: its own node's memory (tier1), another node's (tier2),
        or remote storage (tier3). Recovery records and the cascade speak in these terms."""
        if self.node is None:
            return TIER3
        return TIER1 if self.node == node else TIER2

    def source_node(self, reader_node: str) -> str:
        """The node whose server hands this copy to a reader on ``reader_node``: the node holding it in
        memory, or for remote storage the reader's own node (its leader fetches it)."""
        return self.node if self.node is not None else reader_node

    def describe(self) -> str:
        if self.node is None:
            return "Tier-3"
        return f"{self.node} {'replica' if self.replica else 'own'} area"


@dataclass
class Listing:
    """What one tier holds for the job, as listed at restore."""

    copies: list[Copy] = field(default_factory=list)
    traces: bool = False  # anything of the job exists here (complete or not)
    unknown: str = ""  # why the tier could not be listed (Tier-3 offline at start-up): it may hold anything
    incomplete: int = 0  # leftovers of crashed writes, never loaded
    progress: dict[int, int] = field(default_factory=dict)  # rank -> newest step it reached (Tier-1)
    fingerprints: dict[str, dict] = field(default_factory=dict)  # fingerprint id -> the config keys it names
    notes: list[str] = field(default_factory=list)  # unreadable entries, for the recovery record
    restores: list[dict] = field(default_factory=list)  # the job's restore history (recover.loops)
    headers: list = field(default_factory=list)  # Tier-3's commit record headers when ``copies`` are left out


class Tier(abc.ABC):
    """One checkpoint tier as seen by one rank; see the module docstring for the contract."""

    label: str  # TIER1 | TIER2 | TIER3
    scope: str  # NODE | JOB
    lockstep: bool = False  # units arrive from the loop's thread in lockstep (see the module docstring)
    takes_steps: bool = False  # step units are put here too, not only bases and diff batches
    saves: bool = True  # False: restore reads what an earlier launch left here, the save path puts nothing

    # ---- units -------------------------------------------------------------------------------

    @abc.abstractmethod
    def put(self, payload: EncodedPayload) -> None:
        """Take this rank's finished unit; may return before it is stored (the tier's own thread)."""

    def put_draft(self, draft: PayloadDraft) -> EncodedPayload:
        """Serialize ``draft`` and take it; the first tier of the list serializes for all of them."""
        payload = draft.to_payload()
        self.put(payload)
        return payload

    @abc.abstractmethod
    def list(self) -> Listing:
        """What this tier holds now (for a NODE tier: every owner's units on this node)."""

    def decision_listing(self) -> Listing:
        """What restore's decision from node summaries reads of this tier on its lister: :meth:`list`. Tier-3
        lists its commit record headers instead of every rank's copy (``Listing.headers``)."""
        return self.list()

    def copies_of(self, pids: list[PayloadId], owners: list[tuple[int, int]]) -> tuple[list[Copy], list[str]]:
        """A JOB tier's copies of ``pids`` for the owners in ``owners`` (rank ranges), as a node's leader reads
        them for its ranks after that decision, and a note on each unit it could not read."""
        wanted = set(pids)
        return [c for c in self.list().copies if c.pid in wanted and any(lo <= c.owner < hi for lo, hi in owners)], []

    @abc.abstractmethod
    def read(self, copy: Copy) -> EncodedPayload:
        """The verified bytes of ``copy``, which this rank reaches directly; PayloadError or StoreError if not."""

    @abc.abstractmethod
    def delete(self, pid: PayloadId, owner: Optional[int] = None) -> None:
        """Remove ``owner``'s copy of ``pid`` (every rank's when None); it stops being a source before its
        bytes go, and a missing unit is fine."""

    def where(self) -> str:
        """Where this tier lives, for messages."""
        return self.label

    # ---- the save path's hooks ---------------------------------------------------------------

    def start(self) -> None:
        """Begin background work; called once, after restore (which must see the tier undisturbed)."""

    def record_config(self, fingerprint_id: str, fingerprint: dict) -> None:
        """Keep the run's config fingerprint by its id, so a later restore can name what changed."""

    def record_restores(self, history: list[dict]) -> None:
        """Keep the job's restore history (:mod:`megatier.checkpoint.recover.loops`); called on the rank that
        lists this tier, best effort (a tier that cannot keep it logs why)."""

    def on_step(self, step: int) -> float:
        """The loop's tick after step ``step`` (after a lockstep tier's puts of that step); returns the
        seconds the loop was held up."""
        return 0.0

    def point(self) -> Optional[int]:
        """Newest step this rank could recover from this tier alone (None: nothing yet, or not known here)."""
        return None

    def durable_base(self) -> Optional[int]:
        """Newest base this tier holds durably for every rank (Tier-3's commit; None elsewhere)."""
        return None

    def reclaim(self, watermark: Optional[int]) -> None:
        """Delete what is obsolete: behind ``watermark`` (a base committed everywhere; None before the first)
        and, for node memory, behind its own retention floor. Called at every watermark sync."""

    def pending_bytes(self) -> int:
        """Payload bytes held in host memory until this tier has them."""
        return 0

    def degraded(self) -> Optional[str]:
        """Why this tier cannot store what it is given right now (full, down), or None when it can."""
        return None

    def lag_cause(self) -> Optional[str]:
        """Why this tier is behind, if it is (for the memory-budget warning)."""
        return None

    def metrics(self) -> dict:
        """Per-step figures of this tier for the metrics record."""
        return {}

    def holds_job(self) -> bool:
        """Whether this rank may write the tier now. Tier-3 of a launch that started while it was down: not
        before global rank 0 holds the job's lease again; rank 0's answer reaches every rank with the watermark
        sync, which then calls :meth:`allow_writes`."""
        return True

    def allow_writes(self) -> None:
        """Global rank 0 holds the tier (see :meth:`holds_job`): writes may start."""

    def upload_always(self, version: int) -> None:
        """Take the base of ``version`` whatever a cadence would skip (the final base at exit)."""

    def withhold(self, version: int) -> None:
        """Never take the base of ``version`` (the replica check found the state in doubt; Tier-3 only)."""

    def set_base_interval(self, steps: int) -> None:
        """The steps between bases from now on (base_interval=auto decided it); for tiers that pace by it."""

    def drain(self, step: int, timeout: float) -> None:
        """At close, on every rank at the same ``step``: finish moving what this tier was given."""

    def close(self, timeout: float) -> None:
        """After every rank drained: final work (Tier-3's last commit round), then stop threads."""

    def abort(self, timeout: float) -> None:
        """The job's world broke mid-run (in-process recovery): stop this tier's threads without talking to any
        other rank; what it stored stays a recovery source. By default :meth:`close`, for tiers whose close
        is local."""
        self.close(timeout)

    def behind(self) -> int:
        """After drain: this rank's units the tier was given but could not store (they stay in cheaper tiers)."""
        return 0

    # ---- the recovery path's hooks -----------------------------------------------------------

    def settle(self) -> None:
        """Before the inventory, on the rank that lists this tier: finish what a crashed launch left
        half done, so the listing (and the decision made from it) is the same every time."""

    def quarantine(self, pid: PayloadId, reason: str) -> Optional[str]:
        """On the rank that lists this tier: set aside a unit found corrupt, so it is never offered again and a
        good copy can be committed in its place; returns where it went (None: this tier does not)."""
        return None

    def own_copy(self, pid: PayloadId) -> Optional[EncodedPayload]:
        """This rank's complete, verified copy of ``pid`` held in this tier, if any (for repairs)."""
        return None

    def repair(self, payload: EncodedPayload) -> None:
        """Store again a unit this tier quarantined, from a copy another tier still holds."""

    def discard_after(self, end: int) -> list[str]:
        """After a restore to ``end``, on the rank that lists this tier: delete leftovers of crashed
        writes and units beyond ``end`` that could mix with the resumed run; returns what went."""
        return []
