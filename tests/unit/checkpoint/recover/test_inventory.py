"""The inventory's exchange: each rank's share of its node's listing, and the merged view every rank builds."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatier.checkpoint.format.payload import Stamp
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.recover.inventory import merge, node_servers, share_of, whole
from megatier.checkpoint.tiers.base import JOB, NODE, TIER1, TIER3, Copy, Listing
from megatier.parallel.layout import Layout

pytestmark = pytest.mark.timeout(60)


def copy(rank: int, version: int, node) -> Copy:
    layout = Layout(1, 1, 8, 0, 0, rank)
    return Copy(Stamp(PayloadId.base(version), 10, "0" * 16, "job", layout), TIER3 if node is None else TIER1, node)


def node_listing(node: str, owners) -> Listing:
    return Listing(copies=[copy(o, v, node) for o in owners for v in (0, 50)], traces=True, incomplete=1,
                   progress={o: 60 for o in owners}, notes=[f"{node}: a torn write"], restores=[{"at": 1}])


def test_shares_split_a_node_listing_by_owner_and_put_back_together():
    listing = node_listing("node0", [5, 1, 3, 7])
    shares = [share_of(listing, i, 3) for i in range(3)]
    owners = [{c.owner for c in s.copies} for s in shares]
    assert owners == [{1, 7}, {3}, {5}]  # every third owner, in owner order
    assert shares[0].progress and shares[0].notes and shares[0].restores and shares[0].incomplete == 1
    assert not any(s.progress or s.notes or s.restores or s.incomplete for s in shares[1:])
    back = whole(shares)
    assert sorted(back.copies, key=lambda c: (c.owner, c.pid.version)) == sorted(
        listing.copies, key=lambda c: (c.owner, c.pid.version))
    assert (back.progress, back.notes, back.restores, back.incomplete, back.traces) == (
        listing.progress, listing.notes, listing.restores, 1, True)


def test_merge_builds_one_listing_per_node_whatever_ranks_the_node_got():
    # The rendezvous gave node1 ranks 0 and 2 and node0 ranks 1 and 3: holdings belong to nodes.
    rank_nodes = ["node1", "node0", "node1", "node0"]
    held = {"node0": node_listing("node0", [0, 1]), "node1": node_listing("node1", [2, 3])}
    mates = {n: [r for r, m in enumerate(rank_nodes) if m == n] for n in held}
    shares = [{TIER1: share_of(held[n], mates[n].index(r), 2)} for r, n in enumerate(rank_nodes)]
    remote = Listing(copies=[copy(o, 0, None) for o in range(4)], traces=True)
    tiers = [SimpleNamespace(label=TIER1, scope=NODE), SimpleNamespace(label=TIER3, scope=JOB, where=lambda: "s3://b")]
    inv = merge(rank_nodes, shares, {TIER3: remote}, tiers)
    assert inv.servers == node_servers(rank_nodes) == {"node1": 0, "node0": 1}
    assert [sorted({c.owner for c in ls.copies}) for ls in inv.listings[TIER1]] == [[0, 1], [2, 3]]
    assert inv.listings[TIER3] == [remote]
    assert len(inv.copies) == 8 + 4 and inv.progress == {0: 60, 1: 60, 2: 60, 3: 60}
    assert len(inv.histories) == 2 and len(inv.notes) == 2
    assert inv.looked() == "tier1 on nodes node0, node1 and s3://b"
