"""The decision from per-node summaries, simulated on the world of benchmarks/bench_control_plane.py.

Each node's leader lists its node's memory and sends the decider its summary
(megatier.checkpoint.recover.summary.summarize: a few holdings per node);
rank 0 reads Tier-3's commit record headers (commit_record.parse_header, one
line per 256 ranks) and adds their holdings (by_node.header_holdings). The
decider agrees on V, E and every owner span's chain (``agree``) and sends the
point to every leader; each holder routes the node-memory copies of the
agreed units to the leader of the node that fetches them (``routing.route``),
which reads its ranks' Tier-3 copies from the record parts that hold them
(commit_record.read_markers) and cuts its ranks' plans
(``routing.plans_for``). Figures:

  decider    bytes it receives (the leaders' gather, padded to the largest
             summary), its peak of Python memory (tracemalloc) while it
             unpickles the summaries, agrees and pickles the point, its CPU
             and wall time for that; the point's bytes (what every leader
             receives from it); the holdings it read
  leader     the spare node's leader (its ranks' units are all elsewhere) and
             node 0's: the copies it receives, its CPU to summarize, route its
             own copies and cut its ranks' plans, and its peak of memory for
             receiving and cutting (its own listing is counted in "listing")
  Tier-3     rank 0's CPU to parse every unit's header and make its
             holdings, and the headers' bytes; the leader's CPU to read its
             ranks' markers from the parts (in "leader"); and, for
             comparison, what rank 0 would spend reading whole records (every
             rank's stamp, as before records had parts) and routing them:
             its CPU, record by record, and its peak for one record
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

from benchmarks.control_plane_world import PER_NODE, World, cpu, node_listings, padded, stamps
from megatier.checkpoint.commit.commit_record import CommitRecord, parse_header, read_markers
from megatier.checkpoint.commit.records import DoneMarker, object_key
from megatier.checkpoint.recover.by_node import header_holdings
from megatier.checkpoint.recover.plan import RankPlan
from megatier.checkpoint.recover.routing import plans_for, route, senders
from megatier.checkpoint.recover.summary import Point, agree, holdings_of, interned, part, summarize
from megatier.checkpoint.storage.store import ObjectNotFound, ObjectStore
from megatier.checkpoint.tiers.base import TIER3, Copy

INCARNATION = "launch-3"


class HeldObjects(ObjectStore):
    """Tier-3's commit records as the simulation keeps them: in memory, read only."""

    url = "s3://bucket/job"

    def __init__(self, objects: dict[str, bytes]):
        self.objects = objects
        self.read = 0  # bytes returned by get

    def get(self, key: str) -> bytes:
        if key not in self.objects:
            raise ObjectNotFound(self.describe(key))
        self.read += len(self.objects[key])
        return self.objects[key]

    def exists(self, key: str) -> bool:
        return key in self.objects

    def list(self, prefix: str = "") -> dict[str, int]:
        return {k: len(v) for k, v in self.objects.items() if k.startswith(prefix)}

    def put(self, key: str, data: bytes) -> None:
        raise NotImplementedError("the simulation's Tier-3 is read only")

    put_if_absent = delete = put

    def check(self) -> None:
        pass


def tier3_records(world: World, keep: set[int]) -> tuple[list[bytes], HeldObjects]:
    """Every Tier-3 unit's commit record header, and a store of the parts holding the ranks in ``keep`` (all
    of them when ``keep`` is empty): what the committer writes, built unit by unit."""
    headers, objects = [], {}
    for pid in world.units(tier3=True):
        markers = tuple(DoneMarker(object_key(s), s, INCARNATION) for r in range(world.ranks)
                        for s in stamps(world, r, [pid]))
        header, parts = CommitRecord(pid, markers[0].stamp.job_id, markers[0].stamp.layout.degrees, INCARNATION,
                                     markers).objects()
        ref = parse_header(header, "simulation")
        objects.update((p.key, parts[p.key]) for p in ref.parts if not keep or any(p.lo <= r < p.hi for r in keep))
        headers.append(header)
    return headers, HeldObjects(objects)


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


def _decider(items: list[bytes], tier3: list, job_id: str) -> tuple[Optional[Point], list[bytes], int]:
    """Unpickle the leaders' summaries, add Tier-3's holdings (rank 0's, from the headers), agree, and cut each
    leader its part of the point (the spans of the owners it holds in node memory and of its own ranks),
    pickled for the scatter."""
    table: dict = {}
    by_leader = [interned(pickle.loads(blob).holdings, table) for blob in items]
    point = agree([h for hs in by_leader for h in hs] + tier3, job_id=job_id)
    parts = [pickle.dumps(part(point, [(n * PER_NODE, (n + 1) * PER_NODE), *(r for h in hs for r in h.owners)]))
             for n, hs in enumerate(by_leader)]
    return point, parts, sum(map(len, by_leader)) + len(tier3)


def _leader(world: World, parts: list[bytes], rank_nodes: list[str], node: int, tier3: HeldObjects,
            headers: list) -> dict:
    """One leader's side after the decision, with its part of the point: route its own node-memory copies,
    receive its ranks' copies from their holders (each routing with its own part), read its ranks' Tier-3
    copies from the record parts, cut its ranks' plans."""
    name = rank_nodes[node * PER_NODE]
    ranks = list(range(node * PER_NODE, (node + 1) * PER_NODE))
    mine = pickle.loads(parts[node])
    own = node_listings(world, node)
    _, route_s = cpu(lambda: route(mine, [c for listing in own.values() for c in listing.copies], rank_nodes))
    blobs = []
    for tier, holder in senders(mine, ranks):
        if holder is None:
            continue  # Tier-3: read below, not routed
        src = int(holder.removeprefix("node"))
        copies = node_listings(world, src)[tier].copies
        blobs.append(pickle.dumps(route(pickle.loads(parts[src]), copies, rank_nodes).get(name, [])))
    chain = {p for s in mine.spans_of(ranks[0], ranks[-1] + 1) if (TIER3, None) in s.holders for p in s.chain}
    wanted = [h for h in headers if h.pid in chain]

    def read_tier3():
        return [Copy(m.stamp, TIER3, None) for h in wanted for m in read_markers(tier3, h, ranks[0], ranks[-1] + 1)]

    before = tier3.read
    remote, read_s = cpu(read_tier3)
    read_bytes = tier3.read - before

    def cut_here():
        received = [c for blob in blobs for c in pickle.loads(blob)] + remote
        return [pickle.dumps(p) for p in plans_for(mine, ranks, received, RankPlan(None))]

    (plans, cut_s) = cpu(cut_here)
    _, cut_peak = peak(cut_here)
    return {"receives": sum(map(len, blobs)) + len(parts[node]), "route_s": route_s, "cut_s": cut_s + read_s,
            "t3_read_s": read_s, "t3_read_bytes": read_bytes, "peak": cut_peak, "plans": plans, "senders": len(blobs)}


def whole_records(world: World, point: Point, rank_nodes: list[str]) -> dict:
    """For comparison: rank 0 reading every unit's whole record (every rank's stamp, as before records had
    parts) and routing its copies, one record at a time. Its CPU (building the copies stands for decoding the
    record), its peak for one record."""
    def one(pid):
        copies = [Copy(s, TIER3, None) for r in range(world.ranks) for s in stamps(world, r, [pid])]
        holdings_of(copies)
        return sum(len(pickle.dumps(cs)) for cs in route(point, copies, rank_nodes).values())

    units = world.units(tier3=True)
    _, seconds = cpu(lambda: sum(one(pid) for pid in units))
    _, top = peak(lambda: one(units[-1]))
    return {"t3_whole_cpu_s": seconds, "t3_whole_peak": top}


def simulate(world: World, job_id: str, rank_nodes: list[str], reference: Optional[list[bytes]] = None) -> dict:
    """The decision from summaries for ``world``; with ``reference`` (every rank's pickled plan from the whole
    inventory) every node cuts its plans and each must equal its reference."""
    spare = max(world.lost, 1)  # the spare node's leader (the node after node 0 when no node is lost)
    sampled = sorted({0, spare})
    keep = set() if reference is not None else {r for n in sampled for r in range(n * PER_NODE, (n + 1) * PER_NODE)}
    header_bytes, tier3 = tier3_records(world, keep)
    (headers, tier3_holdings), headers_s = cpu(
        lambda: (hs := [parse_header(b, "simulation") for b in header_bytes], header_holdings(hs)))
    items, summarize_s = [], []
    for node in range(world.nodes):
        listings = node_listings(world, node)
        blob, seconds = cpu(lambda: pickle.dumps(summarize(listings)))
        items.append(blob)
        summarize_s.append(seconds)
    start = time.perf_counter()
    (point, parts, holdings), decide_s = cpu(lambda: _decider(items, tier3_holdings, job_id))
    decide_wall = time.perf_counter() - start
    _, decide_peak = peak(lambda: _decider(items, tier3_holdings, job_id))
    leaders = {n: _leader(world, parts, rank_nodes, n, tier3, headers) for n in sampled}
    mismatched = []
    if reference is not None:
        for node in range(world.nodes):
            got = leaders[node]["plans"] if node in leaders else \
                _leader(world, parts, rank_nodes, node, tier3, headers)["plans"]
            ranks = range(node * PER_NODE, (node + 1) * PER_NODE)
            mismatched += [r for r, blob in zip(ranks, got) if pickle.loads(blob) != pickle.loads(reference[r])]
    whole = whole_records(world, point, rank_nodes)
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
            "new_modeled_s": summary_s + headers_s + decide_s + slowest["route_s"] + slowest["cut_s"],
            "new_mismatched": mismatched if reference is not None else None,
            "t3_headers_cpu_s": headers_s, "t3_header_bytes": sum(map(len, header_bytes)),
            "t3_leader_read_s": max(d["t3_read_s"] for d in leaders.values()),
            "t3_leader_read_bytes": max(d["t3_read_bytes"] for d in leaders.values()), **whole}
