"""A job's checkpoint tiers opened offline, in one process: what they hold and verified reads with fallback.

A restore lists and reads the tiers from inside the job (each node's server
lists its node's memory, rank 0 lists Tier-3, copies travel between ranks).
A tool that runs after the job, on one machine that sees the tiers' storage,
does the same by hand:

- node memory: every node directory under ``<local-root>/<job-id>/``; its own
  areas are Tier-1 copies, its replica areas Tier-2 copies (as the restore
  labels them: :func:`~megatier.checkpoint.tiers.local.list_area`);
- Tier-3: the committed units under ``<remote-url>/<job-id>/``
  (:func:`~megatier.checkpoint.tiers.remote.list_committed`); uncommitted ones
  are never read, only named in messages.

Every read is checksum-verified against the copy's stamp and decoded with the
job id and the layout its stamp names. :meth:`OfflineTiers.load` tries a unit's
copies cheapest first (Tier-1, Tier-2, Tier-3) and falls back past a bad one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from megatier.checkpoint.commit.reader import RemoteReader
from megatier.checkpoint.commit.records import list_units
from megatier.checkpoint.format.payload import PayloadError, decode_base, decode_diff_batch
from megatier.checkpoint.format.units import BASE, PayloadId
from megatier.checkpoint.storage.store import ObjectStore, RetryPolicy, StoreError
from megatier.checkpoint.tiers.base import TIER1, TIER2, TIER3, TIER_ORDER, Copy
from megatier.checkpoint.tiers.local import list_area
from megatier.checkpoint.tiers.node_memory import NodeMemory, read_fingerprints
from megatier.checkpoint.tiers.remote import FINGERPRINTS, list_committed, open_remote_store
from megatier.config import ConfigError

# Exit statuses of the conversion commands (the module docstring of megatier.cli.convert says when).
NOTHING, UNREADABLE = 1, 2
LOAD_ERRORS = (PayloadError, StoreError, ValueError)


class ExportError(RuntimeError):
    """One line for the user (what was wrong and what to do) and the exit status it ends with."""

    def __init__(self, message: str, status: int = NOTHING):
        super().__init__(message)
        self.status = status


@dataclass
class Holdings:
    """Everything the tiers hold for the job: complete copies, config fingerprints, where we looked."""

    copies: list[Copy] = field(default_factory=list)
    fingerprints: dict[str, dict] = field(default_factory=dict)  # id -> key -> JSON value
    traces: bool = False  # anything of the job exists (complete or not)
    looked: list[str] = field(default_factory=list)
    uncommitted: list[PayloadId] = field(default_factory=list)  # Tier-3 units without _COMMITTED
    notes: list[str] = field(default_factory=list)  # incomplete or unreadable entries, never read


@dataclass
class Read:
    """A unit read from one of its copies: the decoded object, the copy, and the copies that failed before it."""

    obj: Any
    copy: Copy
    failed: list[str]


def _short(error: Exception) -> str:
    """The reason in a load error without its path and advice (the copy is named separately)."""
    return str(error).split("; ")[0].rsplit(": ", 1)[-1]


def where(copy: Copy) -> str:
    """``tier1 node0 own area``, ``tier2 node1 replica area``, ``tier3``: a copy for messages."""
    return TIER3 if copy.tier == TIER3 else f"{copy.tier} {copy.describe()}"


def cheapest_first(copies: Sequence[Copy]) -> list[Copy]:
    """A unit's copies in cascade order: own areas (Tier-1), replica areas (Tier-2), Tier-3; by node within."""
    return sorted(copies, key=lambda c: (TIER_ORDER.index(c.tier), c.node or ""))


class OfflineTiers:
    """The tiers ``tiers`` (labels) of job ``job_id``: node memory under ``local_root``, Tier-3 at ``remote_url``."""

    def __init__(self, job_id: str, local_root: str, remote_url: str, *, endpoint_url: Optional[str] = None,
                 tiers: Sequence[str] = TIER_ORDER):
        self.job_id = job_id
        self.local_root = local_root
        self.tiers = tuple(tiers)
        self.store: Optional[ObjectStore] = None
        self.remote_url = remote_url
        if TIER3 in self.tiers:
            try:
                self.store = open_remote_store(remote_url, job_id, endpoint_url=endpoint_url,
                                               retry=RetryPolicy(attempts=3, base_delay_s=0.2, max_delay_s=1.0))
            except ConfigError as e:
                raise ExportError(f"--remote-url {remote_url}: {e}") from None
        self._memories: dict[str, NodeMemory] = {}
        self._reader = RemoteReader(self.store, job_id) if self.store is not None else None

    def _memory(self, node: str) -> NodeMemory:
        if node not in self._memories:
            self._memories[node] = NodeMemory(self.local_root, self.job_id, node)
        return self._memories[node]

    def holdings(self) -> Holdings:
        """List every selected tier; a tier that cannot be listed is an error (exit status 2)."""
        out = Holdings()
        if TIER1 in self.tiers or TIER2 in self.tiers:
            self._list_memory(out)
        if self.store is not None:
            self._list_remote(out)
        return out

    def _list_memory(self, out: Holdings) -> None:
        nodes = NodeMemory.nodes(self.local_root, self.job_id)
        out.looked.append(f"node memory {os.path.join(self.local_root, self.job_id)} ({len(nodes)} nodes)")
        for node in nodes:
            memory = self._memory(node)
            try:
                for label, replica in ((TIER1, False), (TIER2, True)):
                    if label in self.tiers:
                        listing = list_area(memory, label, replica=replica)
                        out.copies += listing.copies
                        out.traces = out.traces or listing.traces
                        out.notes += listing.notes
                out.fingerprints.update(memory.read_fingerprints())
            except (StoreError, OSError) as e:
                raise ExportError(f"cannot list node memory of {node}: {e}", UNREADABLE) from None

    def _list_remote(self, out: Holdings) -> None:
        out.looked.append(f"Tier-3 {self.store.url}")
        try:
            listing = list_committed(self.store)
            out.uncommitted = [pid for pid, unit in list_units(self.store).items() if not unit.committed]
            out.fingerprints.update(read_fingerprints(self.store, FINGERPRINTS))
        except StoreError as e:
            raise ExportError(f"cannot list Tier-3 at {self.remote_url}: {e}; check --remote-url and "
                              f"--endpoint-url, or export from node memory with --tier tier1 --tier tier2",
                              UNREADABLE) from None
        out.copies += listing.copies
        out.notes += listing.notes
        out.traces = out.traces or listing.traces

    def _read(self, copy: Copy) -> Any:
        """The decoded unit of ``copy``: bytes verified against its stamp, identity against job and layout."""
        if copy.tier == TIER3:
            payload = self._reader.load(copy.pid, copy.owner)
        else:
            payload = self._memory(copy.node).load(copy.owner, copy.pid, replica=copy.replica)
        decoder = decode_base if copy.pid.kind == BASE else decode_diff_batch
        return decoder(payload, job_id=self.job_id, layout=copy.stamp.layout, source=copy.describe())

    def load(self, owner: int, pid: PayloadId, copies: Sequence[Copy]) -> Read:
        """Rank ``owner``'s ``pid`` from the first of ``copies`` (cheapest first) that verifies; ExportError
        (exit status 2) naming the unit, the rank and every copy's problem when none does."""
        failed = []
        for copy in cheapest_first(copies):
            try:
                return Read(self._read(copy), copy, failed)
            except LOAD_ERRORS as e:
                failed.append(f"{where(copy)}: {_short(e)}")
        tried = "; ".join(failed) or "no copy in the tiers read"
        others = "read the other tiers too (drop --tier) or " if set(TIER_ORDER) - set(self.tiers) else ""
        raise ExportError(f"rank {owner}'s {pid} has no good copy ({tried}); {others}export an older step with "
                          f"--step", UNREADABLE)
