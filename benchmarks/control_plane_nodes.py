"""The decision from per-node summaries, simulated on the world of benchmarks/bench_control_plane.py.

Each node's leader lists its node's memory and Tier-3's units of the ranks
that run on it, and sends the decider its summary
(megatier.checkpoint.recover.summary.summarize: a few holdings per node); the
decider agrees on V, E and every owner span's chain (``agree``) and sends the
point to every leader; each holder routes the copies of the agreed units to
the leader of the node that fetches them (``routing.route``), which cuts its
ranks' plans (``routing.plans_for``). Figures:

  decider    bytes it receives (the leaders' gather, padded to the largest
             summary), its peak of Python memory (tracemalloc) while it
             unpickles the summaries, agrees and pickles the point, its CPU
             and wall time for that; the point's bytes (what every leader
             receives from it); the holdings it read
  leader     the spare node's leader (its ranks' units are all elsewhere) and
             node 0's: the copies it receives, its CPU to summarize, route its
             own copies and cut its ranks' plans, and its peak of memory for
             receiving and cutting (its own listing is counted in "listing")
  Tier-3     today's Tier-3 (one commit record per unit, every rank's stamp
             in it, listed by rank 0) instead of each leader listing its
             ranks' units: rank 0's CPU to summarize and route it, record by
             record, and its peak for one record
  modeled    the critical path: a leader's summary (the median: every
             leader does the same work), the decider, the slower sampled
             leader's routing and plan cutting; no network time

With ``check`` (small worlds), every node routes and cuts, and each plan must
equal the plan rank 0 cut from the whole inventory.
"""
from __future__ import annotations

import gc
import pickle
import time
import tracemalloc
from typing import Callable, Optional

from benchmarks.control_plane_world import PER_NODE, World, cpu, leader_listings, padded, stamps
from megatier.checkpoint.recover.plan import RankPlan
from megatier.checkpoint.recover.routing import plans_for, route, senders
from megatier.checkpoint.recover.summary import Point, agree, holdings_of, interned, part, summarize
from megatier.checkpoint.tiers.base import TIER3, Copy


def peak(fn: Callable):
    """``fn()`` and the peak of Python memory it allocated (bytes). The collector is run before and held off
    during the call, so the peak is the call's own, not wherever a collection happened to fall."""
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        gc.enable()


def _decider(items: list[bytes], job_id: str) -> tuple[Optional[Point], list[bytes], int]:
    """Unpickle the leaders' summaries, agree, and cut each leader its part of the point (the spans of the
    owners it holds and of its own ranks), pickled for the scatter."""
    table: dict = {}
    by_leader = [interned(pickle.loads(blob).holdings, table) for blob in items]
    point = agree([h for hs in by_leader for h in hs], job_id=job_id)
    parts = [pickle.dumps(part(point, [(n * PER_NODE, (n + 1) * PER_NODE), *(r for h in hs for r in h.owners)]))
             for n, hs in enumerate(by_leader)]
    return point, parts, sum(map(len, by_leader))


def _leader(world: World, parts: list[bytes], rank_nodes: list[str], node: int) -> dict:
    """One leader's side after the decision, with its part of the point: route its own copies, receive its
    ranks' copies from their holders (each routing with its own part), cut its ranks' plans."""
    name = rank_nodes[node * PER_NODE]
    ranks = list(range(node * PER_NODE, (node + 1) * PER_NODE))
    mine = pickle.loads(parts[node])
    own = leader_listings(world, node)
    _, route_s = cpu(lambda: route(mine, [c for listing in own.values() for c in listing.copies], rank_nodes))
    blobs = []
    for tier, holder in senders(mine, ranks):
        src = node if holder is None else int(holder.removeprefix("node"))
        copies = leader_listings(world, src)[tier].copies
        blobs.append(pickle.dumps(route(pickle.loads(parts[src]), copies, rank_nodes).get(name, [])))

    def cut_here():
        received = [c for blob in blobs for c in pickle.loads(blob)]
        return [pickle.dumps(p) for p in plans_for(mine, ranks, received, RankPlan(None))]

    (plans, cut_s) = cpu(cut_here)
    _, cut_peak = peak(cut_here)
    return {"receives": sum(map(len, blobs)) + len(parts[node]), "route_s": route_s, "cut_s": cut_s,
            "peak": cut_peak, "plans": plans, "senders": len(blobs)}


def tier3_as_today(world: World, point: Point, rank_nodes: list[str]) -> dict:
    """Tier-3 as its commit records are laid out today (one record per unit naming every rank's stamp, read by
    rank 0): rank 0 summarizes and routes it one record at a time. Its CPU (building the copies stands for
    decoding the record), its peak for one record, the bytes it sends."""
    def one(pid):
        copies = [Copy(s, TIER3, None) for r in range(world.ranks) for s in stamps(world, r, [pid])]
        holdings_of(copies)
        return sum(len(pickle.dumps(cs)) for cs in route(point, copies, rank_nodes).values())

    units = world.units(tier3=True)
    sent, seconds = cpu(lambda: sum(one(pid) for pid in units))
    _, top = peak(lambda: one(units[-1]))
    return {"t3_lister_cpu_s": seconds, "t3_lister_peak": top, "t3_lister_sends": sent}


def simulate(world: World, job_id: str, rank_nodes: list[str], reference: Optional[list[bytes]] = None) -> dict:
    """The decision from summaries for ``world``; with ``reference`` (every rank's pickled plan from the whole
    inventory) every node cuts its plans and each must equal its reference."""
    items, summarize_s = [], []
    for node in range(world.nodes):
        listings = leader_listings(world, node)
        blob, seconds = cpu(lambda: pickle.dumps(summarize(listings)))
        items.append(blob)
        summarize_s.append(seconds)
    start = time.perf_counter()
    (point, parts, holdings), decide_s = cpu(lambda: _decider(items, job_id))
    decide_wall = time.perf_counter() - start
    _, decide_peak = peak(lambda: _decider(items, job_id))
    spare = max(world.lost, 1)  # the spare node's leader (the node after node 0 when no node is lost)
    leaders = {n: _leader(world, parts, rank_nodes, n) for n in sorted({0, spare})}
    mismatched = []
    if reference is not None:
        for node in range(world.nodes):
            got = leaders[node]["plans"] if node in leaders else _leader(world, parts, rank_nodes, node)["plans"]
            ranks = range(node * PER_NODE, (node + 1) * PER_NODE)
            mismatched += [r for r, blob in zip(ranks, got) if pickle.loads(blob) != pickle.loads(reference[r])]
    today = tier3_as_today(world, point, rank_nodes)
    summary_s = sorted(summarize_s)[len(summarize_s) // 2]  # every leader summarizes the same; the median, not
    # the largest of thousands of samples on a loaded box
    slowest = max(leaders.values(), key=lambda d: d["cut_s"] + d["route_s"])
    spare = leaders[spare]
    return {"new_decider_receives": padded([len(b) for b in items]), "new_decider_peak": decide_peak,
            "new_decider_cpu_s": decide_s, "new_decider_wall_s": decide_wall,
            "new_point_bytes": padded([len(b) for b in parts]),
            "new_holdings": holdings, "new_spans": len(point.spans), "new_summary_bytes": max(map(len, items)),
            "new_leader_receives": spare["receives"], "new_leader_peak": max(d["peak"] for d in leaders.values()),
            "new_leader_cpu_s": summary_s + slowest["route_s"] + slowest["cut_s"],
            "new_senders": spare["senders"], "new_version": point.version, "new_end": point.end,
            "new_modeled_s": summary_s + decide_s + slowest["route_s"] + slowest["cut_s"],
            "new_mismatched": mismatched if reference is not None else None, **today}

