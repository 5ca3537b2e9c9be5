"""Recovery inventory: every tier's listing, gathered once, merged into one view every rank shares.

Each rank lists its node-scope tiers (Tier-1 own areas, Tier-2 replica areas:
its node's memory) and rank 0 lists the job-scope tier (Tier-3's committed
units). One gather gives every rank every listing; :func:`merge` then keeps,
for a node-scope tier, the listing of each node's *server* (its lowest global
rank: holdings belong to nodes, and global ranks may land on other nodes than
in the previous launch) and for a job-scope tier rank 0's. Every rank derives
the same merged :class:`Inventory` from the same gathered data, so the
consensus that follows needs no further messages.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from megatier.checkpoint.comm import CheckpointComm
from megatier.checkpoint.tiers.base import JOB, Copy, Listing, Tier


class RecoveryError(RuntimeError):
    """Recovery cannot produce a consistent state; raised on every rank with the same message."""


class ConfigRefusal(RecoveryError):
    """The job's checkpoints were written by another configuration or job: the launch's config is refused (the
    message names what differs and the fix), the checkpoints are left as they are."""


def raise_fatal(statuses: list[dict], what: str) -> None:
    """Raise one RecoveryError naming every rank whose status carries a fatal error."""
    fatal = [f"rank {r}: {s['fatal']}" for r, s in enumerate(statuses) if s.get("fatal")]
    if fatal:
        raise RecoveryError(f"recovery failed during {what}: " + "; ".join(fatal))


@dataclass
class Inventory:
    """Where every rank runs, which rank serves each node, and every tier's merged listing."""

    rank_nodes: list[str]
    servers: dict[str, int]  # node -> its lowest global rank
    listings: dict[str, list[Listing]] = field(default_factory=dict)  # tier label -> one listing per lister
    places: list[str] = field(default_factory=list)  # where we looked, for messages

    @property
    def copies(self) -> list[Copy]:
        return [c for ls in self.listings.values() for listing in ls for c in listing.copies]

    @property
    def traces(self) -> bool:
        """Whether anything of this job exists in any tier (a file, a progress key, any Tier-3 object)."""
        return any(listing.traces for ls in self.listings.values() for listing in ls)

    @property
    def progress(self) -> dict[int, int]:
        return {r: s for ls in self.listings.values() for listing in ls for r, s in listing.progress.items()}

    @property
    def fingerprints(self) -> dict[str, dict]:
        return {i: fp for ls in self.listings.values() for listing in ls for i, fp in listing.fingerprints.items()}

    @property
    def histories(self) -> list[list[dict]]:
        """The restore history each lister's listing holds (megatier.checkpoint.recover.loops)."""
        return [listing.restores for ls in self.listings.values() for listing in ls if listing.restores]

    @property
    def notes(self) -> list[str]:
        return [n for ls in self.listings.values() for listing in ls for n in listing.notes]

    def has_copies(self, label: str) -> bool:
        return any(listing.copies for listing in self.listings.get(label, []))

    def looked(self) -> str:
        return " and ".join(self.places) if self.places else "no tier (none configured)"


def merge(items: Sequence[dict], tiers: Sequence[Tier]) -> Inventory:
    """The shared Inventory from every rank's gathered item ``{"node", "listings": {label: Listing}}``."""
    rank_nodes = [it["node"] for it in items]
    servers: dict[str, int] = {}
    for r, node in enumerate(rank_nodes):
        servers.setdefault(node, r)  # ranks are visited in order: the lowest rank of each node serves it
    inv = Inventory(rank_nodes, servers)
    for tier in tiers:
        listers = [0] if tier.scope == JOB else [servers[n] for n in sorted(servers)]
        inv.listings[tier.label] = [items[r]["listings"][tier.label] for r in listers]
        where = tier.where() if tier.scope == JOB else f"{tier.label} on nodes {', '.join(sorted(servers))}"
        inv.places.append(where)
    return inv


def take_inventory(comm: CheckpointComm, tiers: Sequence[Tier], node: str) -> Inventory:
    """Collective: settle and list what this rank should list, gather, merge; a failure anywhere fails
    every rank."""
    item: dict = {"node": node, "listings": {}, "fatal": None}
    try:
        for tier in tiers:
            if tier.scope != JOB or comm.rank == 0:
                tier.settle()
                item["listings"][tier.label] = tier.list()
    except Exception as e:  # an unreadable area or an unreachable Tier-3 must stop every rank, not only this one
        item["fatal"] = f"inventory on {node} failed: {type(e).__name__}: {e}"
    items = comm.gather(item, what="the recovery inventory")
    raise_fatal(items, "the inventory")
    return merge(items, tiers)


def last_step(inv: Inventory) -> Optional[int]:
    """The newest step any rank reached before the failure (from Tier-1's progress keys)."""
    progress = inv.progress
    return max(progress.values()) if progress else None
