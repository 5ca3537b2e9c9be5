"""The decision from per-node summaries agrees with the consensus on the whole inventory, and the plans each
node's leader cuts from the routed copies are the plans rank 0 cut."""
from __future__ import annotations

import random

import pytest

from megatier.checkpoint.format.payload import Stamp
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.recover.consensus import ConfigCheck, decide
from megatier.checkpoint.recover.inventory import RecoveryError
from megatier.checkpoint.recover.plan import RankPlan, cut
from megatier.checkpoint.recover.routing import plans_for, route, senders
from megatier.checkpoint.recover.summary import Holding, agree, holdings_of, interned, part, ranges, summarize
from megatier.checkpoint.tiers.base import TIER1, TIER2, TIER3, Copy, Listing
from megatier.parallel.layout import Layout

pytestmark = pytest.mark.timeout(120)

JOB = "job"
DEG = (2, 2, 2)  # tp, pp, dp: a world of 8 on 4 nodes of 2 ranks
PER_NODE = 2
UNITS = [PayloadId.base(0), PayloadId.base(10), *(PayloadId.diff(f, f + 1) for f in range(11, 21, 2))]


def stamp(rank, pid, job=JOB, degrees=DEG, fingerprint=""):
    tp, pp, dp = degrees
    layout = Layout(tp, pp, dp, rank % tp, rank // (tp * dp), (rank // tp) % dp)
    return Stamp(pid, 100, f"{rank:04x}{pid.first:06x}{pid.last:06x}", job, layout, fingerprint)


def world_of(rng: random.Random, nodes: int = 4, keep: float = 0.85, lost: int = -1):
    """Node listings (Tier-1: own ranks, Tier-2: the ring predecessor's) and Tier-3's, each copy kept with
    probability ``keep``; node ``lost`` has no memory left."""
    world = nodes * PER_NODE
    listings = {}
    for n in range(nodes):
        name = f"node{n}"
        if n == lost:
            listings[name] = {TIER1: Listing(), TIER2: Listing()}
            continue
        own = range(n * PER_NODE, (n + 1) * PER_NODE)
        pred = range(((n - 1) % nodes) * PER_NODE, ((n - 1) % nodes + 1) * PER_NODE)
        t1 = [Copy(stamp(r, p), TIER1, name) for r in own for p in UNITS if rng.random() < keep]
        t2 = [Copy(stamp(r, p), TIER2, name) for r in pred for p in UNITS if rng.random() < keep]
        listings[name] = {TIER1: Listing(copies=t1, traces=True, progress={r: 20 for r in own}),
                          TIER2: Listing(copies=t2, traces=True)}
    t3 = [Copy(stamp(r, p), TIER3, None) for r in range(world) for p in UNITS[:-1] if rng.random() < keep]
    return world, listings, Listing(copies=t3, traces=True)


def inventory_order(listings, t3):
    """The copies in the merged inventory's order: Tier-1 by node, Tier-2 by node, Tier-3."""
    nodes = sorted(listings)
    return [c for tier in (TIER1, TIER2) for n in nodes for c in listings[n][tier].copies] + t3.copies


def from_summaries(world, listings, t3, job=JOB):
    """Every leader's summary (Tier-3 summarized by its lister), the decider's point, and each node's plans."""
    table: dict = {}
    holdings = [h for n in sorted(listings) for h in interned(summarize(listings[n]).holdings, table)]
    holdings += summarize({TIER3: t3}).holdings
    point = agree(holdings, job_id=job)
    if point is None:
        return None, None
    rank_nodes = [f"node{r // PER_NODE}" for r in range(world)]
    inbox: dict[str, list[Copy]] = {}
    for lister in [*(listings[n][t] for n in sorted(listings) for t in (TIER1, TIER2)), t3]:
        for node, cs in route(point, lister.copies, rank_nodes).items():
            inbox.setdefault(node, []).extend(cs)
    plans = []
    for n in range(world // PER_NODE):
        ranks = list(range(n * PER_NODE, (n + 1) * PER_NODE))
        plans += plans_for(point, ranks, inbox.get(f"node{n}", []), RankPlan(None))
    return point, plans


@pytest.mark.parametrize("seed", range(40))
def test_summaries_agree_with_the_whole_inventory_and_cut_the_same_plans(seed):
    rng = random.Random(seed)
    world, listings, t3 = world_of(rng, keep=rng.choice([0.7, 0.9, 1.0]), lost=rng.choice([-1, 1, 2]))
    copies = inventory_order(listings, t3)
    point, plans = from_summaries(world, listings, t3)
    try:
        ref = decide(copies, job_id=JOB, degrees=DEG, traces=True, allow_fresh_start=False, looked="x")
    except RecoveryError:
        assert point is None  # no common base: the full consensus decides (and names what is missing)
        return
    if point is None:  # only when the fast path does not apply: some rank has nothing anywhere
        assert any(not any(c.owner == r for c in copies) for r in range(world))
        return
    assert (point.version, point.end, point.degrees) == (ref.version, ref.end, ref.degrees)
    rank_nodes = [f"node{r // PER_NODE}" for r in range(world)]
    assert plans == cut(ref, rank_nodes, DEG, RankPlan(None))


def test_a_node_summary_is_a_few_holdings_whatever_its_ranks():
    listings = {TIER1: Listing(copies=[Copy(stamp(r, p), TIER1, "node0") for r in range(4) for p in UNITS],
                               traces=True, progress={0: 19, 1: 20, 2: 20, 3: 18})}
    summary = summarize(listings)
    assert summary.holdings == [Holding(TIER1, "node0", JOB, "", DEG, tuple(sorted(UNITS)), ((0, 4),))]
    assert summary.facts[TIER1].copies == [] and max(summary.facts[TIER1].progress.values()) == 20


def test_owners_with_other_units_get_their_own_holding():
    cs = [Copy(stamp(r, p), TIER1, "n") for r in (0, 1, 3) for p in UNITS] + [Copy(stamp(2, UNITS[0]), TIER1, "n")]
    got = {h.owners: h.pids for h in holdings_of(cs)}
    assert got == {((0, 2), (3, 4)): tuple(sorted(UNITS)), ((2, 3),): (UNITS[0],)}
    assert ranges([5, 1, 2, 3, 7]) == ((1, 4), (5, 6), (7, 8))


def _holding(owners, job=JOB, degrees=DEG, fingerprint="", pids=tuple(UNITS)):
    return Holding(TIER1, "node0", job, fingerprint, degrees, pids, owners)


def test_the_full_consensus_decides_whatever_the_fast_path_does_not_cover():
    whole = ((0, 8),)
    assert agree([_holding(whole)], job_id=JOB).version == 10
    assert agree([_holding(whole, job="other")], job_id=JOB) is None  # another job's copies: refused by name
    assert agree([_holding(whole), _holding(((0, 2),), degrees=(1, 1, 2))], job_id=JOB) is None  # two layouts
    assert agree([_holding(((0, 7),))], job_id=JOB) is None  # rank 7 holds nothing
    assert agree([_holding(((0, 9),))], job_id=JOB) is None  # a rank outside the layout
    assert agree([_holding(((0, 4),), pids=(UNITS[0],)), _holding(((4, 8),), pids=(UNITS[1],))], job_id=JOB) is None
    config = ConfigCheck("new", known={})
    assert agree([_holding(whole, fingerprint="old")], job_id=JOB, config=config) is None


def test_the_spare_nodes_leader_hears_from_the_holders_of_its_ranks_units_only():
    rng = random.Random(7)
    world, listings, t3 = world_of(rng, keep=1.0, lost=2)
    point, plans = from_summaries(world, listings, t3)
    assert (point.version, point.end) == (10, 20)
    # node2 lost its memory: its ranks' units are in node3's replica area and in Tier-3
    assert senders(point, [4, 5]) == [(TIER2, "node3"), (TIER3, None)]
    assert senders(point, [0, 1]) == [(TIER1, "node0"), (TIER2, "node1"), (TIER3, None)]
    assert [len(p.consensus.chains[4]) for p in plans[4:5]] == [1 + 5]


def test_a_leaders_part_of_the_point_has_the_spans_it_holds_and_cuts_only():
    holdings = [_holding(((lo, lo + 2),)) for lo in range(0, 8, 2)]
    point = agree(holdings, job_id=JOB)
    assert [(s.lo, s.hi) for s in point.spans] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    mine = part(point, [(4, 6), (2, 3)])
    assert [(s.lo, s.hi) for s in mine.spans] == [(2, 4), (4, 6)]
    assert (mine.version, mine.end, mine.rounds) == (point.version, point.end, point.rounds)
