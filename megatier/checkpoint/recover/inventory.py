"""Recovery inventory: every tier's listing, gathered on rank 0 and merged into one view there.

Each rank lists its node-scope tiers (Tier-1 own areas, Tier-2 replica areas:
its node's memory) and sends its share of them to rank 0, which lists the
job-scope tier (Tier-3's committed units) itself. :func:`merge` puts each
node's listing back together from its ranks' shares (holdings belong to
nodes, and global ranks may land on other nodes than in the previous launch;
the node's lowest global rank is its *server*). Rank 0 alone holds the merged
:class:`Inventory` and decides for every rank (:mod:`.plan`); the others hold
the node names and their own plan. benchmarks/bench_control_plane.py
measures what each holds and receives.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
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
    def unknown(self) -> list[str]:
        """Why each tier that could not be listed was not (Tier-3 offline at start-up)."""
        return [listing.unknown for ls in self.listings.values() for listing in ls if listing.unknown]

    @property
    def known_traces(self) -> bool:
        """Whether the tiers that could be listed hold anything of this job."""
        return any(listing.traces for ls in self.listings.values() for listing in ls if not listing.unknown)

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


def node_servers(rank_nodes: Sequence[str]) -> dict[str, int]:
    """node -> its server, the node's lowest global rank."""
    servers: dict[str, int] = {}
    for r, node in enumerate(rank_nodes):
        servers.setdefault(node, r)  # ranks are visited in order: the lowest rank of each node serves it
    return servers


def share_of(listing: Listing, index: int, count: int) -> Listing:
    """The part of a node tier's ``listing`` that the node's rank ``index`` of ``count`` sends: the copies of
    every ``count``-th owner (in owner order) from ``index`` on; the node-wide fields go with index 0 only.

    Every rank of a node lists the same memory, and each sends a share, so the gather's items are about equal
    (:meth:`CheckpointComm.gather` pads every item to the largest one)."""
    owners = sorted({c.owner for c in listing.copies})
    mine = set(owners[index::count])
    copies = [c for c in listing.copies if c.owner in mine]
    if index:
        return Listing(copies=copies, traces=listing.traces)
    return replace(listing, copies=copies)


def whole(shares: Sequence[Listing]) -> Listing:
    """A node tier's listing from its ranks' shares (:func:`share_of`), the first carrying the node-wide fields."""
    first = shares[0]
    return replace(first, copies=[c for share in shares for c in share.copies],
                   traces=any(share.traces for share in shares))


def merge(rank_nodes: Sequence[str], shares: Sequence[dict[str, Listing]], job: dict[str, Listing],
          tiers: Sequence[Tier]) -> Inventory:
    """The shared Inventory from every rank's node (``rank_nodes``) and node-tier shares (``shares``, by rank:
    tier label -> :func:`share_of`) and rank 0's job-tier listings (``job``)."""
    servers = node_servers(rank_nodes)
    inv = Inventory(list(rank_nodes), servers)
    by_node: dict[str, list[int]] = {}
    for r, node in enumerate(rank_nodes):
        by_node.setdefault(node, []).append(r)
    for tier in tiers:
        if tier.scope == JOB:
            inv.listings[tier.label] = [job[tier.label]]
            inv.places.append(tier.where())
        else:
            inv.listings[tier.label] = [whole([shares[r][tier.label] for r in by_node[n]]) for n in sorted(servers)]
            inv.places.append(f"{tier.label} on nodes {', '.join(sorted(servers))}")
    return inv


@dataclass
class Collected:
    """What rank 0 holds after the exchange: every rank's share of its node's listings (and its failure, if
    any) and its own listing of the job-scope tiers."""

    rank_nodes: list[str]
    items: list[dict]
    job: dict[str, Listing]

    def inventory(self, tiers: Sequence[Tier]) -> Inventory:
        """The merged Inventory; RecoveryError naming every rank whose listing failed."""
        raise_fatal(self.items, "the inventory")
        return merge(self.rank_nodes, [it["shares"] for it in self.items], self.job, tiers)


def node_names(comm: CheckpointComm, node: str) -> list[str]:
    """Collective: every rank's node (a few bytes per rank, on every rank: transfers need them)."""
    return comm.gather(node, what="the recovery inventory (node names)")


def take_inventory(comm: CheckpointComm, tiers: Sequence[Tier], node: str, rank_nodes: list[str]
                   ) -> Optional[Collected]:
    """Collective: settle and list what this rank should list and send it to rank 0, which decides for every
    rank (:mod:`.plan`). Returns on rank 0 what it collected (None elsewhere).

    Every rank's share of its node's listings (:func:`share_of`) is gathered on rank 0 only; rank 0 lists
    the job-scope tier itself. So a rank other than 0 holds none of the other ranks' listings."""
    mates = [r for r, n in enumerate(rank_nodes) if n == node]
    shares: dict[str, Listing] = {}
    job: dict[str, Listing] = {}
    fatal = None
    try:
        for tier in tiers:
            if tier.scope != JOB:
                if comm.rank == mates[0]:
                    tier.settle()
                shares[tier.label] = share_of(tier.list(), mates.index(comm.rank), len(mates))
            elif comm.rank == 0:
                tier.settle()
                job[tier.label] = tier.list()
    except Exception as e:  # an unreadable area or an unreachable Tier-3 must stop every rank, not only this one
        fatal = f"inventory on {node} failed: {type(e).__name__}: {e}"
    items = comm.collect({"shares": shares, "fatal": fatal}, what="the recovery inventory (node memory)")
    return Collected(rank_nodes, items, job) if items is not None else None


def last_step(inv: Inventory) -> Optional[int]:
    """The newest step any rank reached before the failure (from Tier-1's progress keys)."""
    progress = inv.progress
    return max(progress.values()) if progress else None
