"""Recovery's control plane at 1k to 100k ranks, simulated in one process on a synthetic inventory.

Every rank of a job runs the same control plane when it recovers: it exchanges
the inventory, merges it, agrees on the base V and the end E, and plans each
round of the cascade. Those steps are pure functions of what was exchanged, so
one process can run one rank's share of them for a world it does not have.
This script builds the inventory such a world leaves behind and runs MegaTier's
own functions on it:

  world      tp 8 (one node of 8 ranks), pp 16, dp the rest; every rank has 2
             bases (steps 0 and 50) and a 50-step chain after the newer one
             (diff batches of --batch steps) in its node's memory (Tier-1) and
             in its ring successor's (Tier-2); Tier-3 holds the bases and
             every batch but the newest (its upload was in flight)
  failure    one node lost: its memory is gone (its ranks' own copies and the
             replicas it held); a spare node with empty memory runs its ranks

Phases, per rank (each rank does the same work on the same data):

  exchange   bytes received by each rank: the node names, every rank's share of
             its node's listing (an all-gather: torch pads every item to the
             largest), rank 0's Tier-3 listing (a broadcast); CPU time to
             unpickle them. ``old exchange`` is the single gather used before,
             where each rank sent its node's whole listing and rank 0 Tier-3's
             as well, computed from the same item sizes
  merge      the Inventory from the exchanged data
  consensus  decide(): V, E, every rank's chain and the copies of each unit
  plan       every cascade round's candidate lists (Fetcher.plan)
  status     the status gathers of the cascade's rounds (bytes per rank)
  round      in-process recovery's membership round on an in-memory store:
             every survivor joins (CPU per join), the spare node's ranks join
             as spares, the lost node's processes are reported dead; the
             deciding survivor reads the member list once and assigns the
             ranks (its CPU); every member reads the decision (bytes per rank)

Figures are CPU seconds of this one thread (time.process_time) and bytes; they
do not depend on the machine's load.

    python benchmarks/bench_control_plane.py                      # 1k, 16k, 100k ranks (~10 min, ~8 GiB)
    python benchmarks/bench_control_plane.py --ranks 1024,2048 --out-json cp.json
"""
from __future__ import annotations

import argparse
import json
import math
import pickle
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch.distributed as dist

from megatier.checkpoint.format.payload import Stamp
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.recover.cascade import Fetcher
from megatier.checkpoint.recover.consensus import decide
from megatier.checkpoint.recover.inventory import Inventory, merge, share_of
from megatier.checkpoint.tiers.base import JOB, NODE, TIER1, TIER2, TIER3, Copy, Listing
from megatier.parallel.assignment import Member
from megatier.parallel.layout import Layout, coordinates_of
from megatier.parallel.membership import MembershipRound

TP, PP, PER_NODE = 8, 16, 8
JOB_ID = b"gpt-llama-70b"
FINGERPRINT = b"3f9a0c2d11e4b7a5"
TIERS = [SimpleNamespace(label=TIER1, scope=NODE), SimpleNamespace(label=TIER2, scope=NODE),
         SimpleNamespace(label=TIER3, scope=JOB, where=lambda: "s3://bucket/job")]


@dataclass
class World:
    ranks: int
    batch: int
    lost: int = 1  # the node whose memory is gone

    @property
    def dp(self) -> int:
        return self.ranks // (TP * PP)

    @property
    def nodes(self) -> int:
        return self.ranks // PER_NODE

    def units(self, tier3: bool = False) -> list[PayloadId]:
        """A rank's units: bases 0 and 50, then the diff batches of steps 51..100 (Tier-3 lacks the newest)."""
        diffs = [PayloadId.diff(first, min(first + self.batch - 1, 100)) for first in range(51, 101, self.batch)]
        return [PayloadId.base(0), PayloadId.base(50), *(diffs[:-1] if tier3 else diffs)]

    def node_of(self, rank: int) -> str:
        node = rank // PER_NODE
        return "spare0" if node == self.lost else f"node{node}"


def stamps(world: World, rank: int, pids: list[PayloadId]) -> list[Stamp]:
    """Stamps as a tier reads them from their files: each its own strings (so pickling shares nothing)."""
    tp_rank, dp_rank, pp_rank = coordinates_of(rank, tp=TP, dp=world.dp)
    layout = Layout(TP, PP, world.dp, tp_rank, pp_rank, dp_rank)
    return [Stamp(p, 1 << 20, f"{(rank * 7919 + p.last) & 0xFFFFFFFFFFFFFFFF:016x}", JOB_ID.decode(), layout,
                  FINGERPRINT.decode()) for p in pids]


def node_listings(world: World, node: int) -> dict[str, Listing]:
    """What node ``node``'s memory lists: its ranks' units (Tier-1) and its ring predecessor's (Tier-2)."""
    name = f"node{node}"
    if node == world.lost:
        return {TIER1: Listing(), TIER2: Listing()}
    own = range(node * PER_NODE, (node + 1) * PER_NODE)
    pred = (node - 1) % world.nodes
    replicas = range(pred * PER_NODE, (pred + 1) * PER_NODE)  # the lost node's own replicas survive here
    t1 = [Copy(s, TIER1, name) for r in own for s in stamps(world, r, world.units())]
    t2 = [Copy(s, TIER2, name) for r in replicas for s in stamps(world, r, world.units())]
    return {TIER1: Listing(copies=t1, traces=True, progress={r: 100 for r in own}),
            TIER2: Listing(copies=t2, traces=bool(t2))}


def cpu(fn: Callable):
    start = time.process_time()
    out = fn()
    return out, time.process_time() - start


def gathered(sizes: list[int]) -> int:
    """Bytes every rank receives from an all_gather_object of items of ``sizes``: each padded to the largest."""
    return len(sizes) * max(sizes)


def exchange(world: World, rank_nodes: list[str]) -> tuple[Inventory, dict]:
    """Every rank's items pickled as it would send them, and one rank's receive side: unpickle and merge."""
    names = pickle.dumps(rank_nodes[0])
    remote = Listing(copies=[Copy(s, TIER3, None) for r in range(world.ranks)
                             for s in stamps(world, r, world.units(tier3=True))], traces=True)
    job_blob = pickle.dumps({TIER3: remote})
    items, old_sizes, build_s = [], [], 0.0
    for node in range(world.nodes):
        listings, seconds = cpu(lambda: node_listings(world, node))
        build_s += seconds
        whole_item = len(pickle.dumps({"node": "x", "listings": listings, "fatal": None}))
        for i in range(PER_NODE):
            shares = {label: share_of(listing, i, PER_NODE) for label, listing in listings.items()}
            items.append(pickle.dumps({"shares": shares, "fatal": None}))
            old_sizes.append(whole_item + (len(job_blob) if node == 0 and i == 0 else 0))
    received, unpickle_s = cpu(lambda: ([pickle.loads(b)["shares"] for b in items], pickle.loads(job_blob)))
    inv, merge_s = cpu(lambda: merge(rank_nodes, received[0], received[1], TIERS))
    sizes = {"exchange_bytes": gathered([len(names)] * world.ranks) + gathered([len(b) for b in items])
             + len(job_blob), "old_exchange_bytes": gathered(old_sizes)}
    return inv, {**sizes, "cpu_s": {"listing": build_s / world.nodes, "unpickle": unpickle_s, "merge": merge_s}}


def membership_round(world: World) -> dict:
    """The round after the lost node: survivors and the spare node's processes join, the decider decides."""
    store = dist.HashStore()
    members = [Member(f"node{r // PER_NODE}/{r % PER_NODE}", f"node{r // PER_NODE}") for r in range(world.ranks)]
    lost = set(range(world.lost * PER_NODE, (world.lost + 1) * PER_NODE))
    rnd = MembershipRound(store, 1)
    for r in sorted(lost):
        rnd.report_dead(members[r].id)
    _, join_s = cpu(lambda: [rnd.join(m, survivor=True) for r, m in enumerate(members) if r not in lost])
    for i in range(PER_NODE):
        rnd.join(Member(f"spare0/{i}", "spare0"), survivor=False)
    outcome, decide_s = cpu(lambda: rnd.decide((TP, PP, world.dp), members, deadline_s=60.0, shrink=False))
    taken = [outcome.assignment.holders[r] for r in sorted(lost)]
    return {"round_spares_taken": sum(h.startswith("spare0/") for h in taken),
            "round_decision_bytes": len(store.get(f"{rnd.key}/decision")),
            "round_member_bytes": sum(len(v) for v in store.multi_get(
                [f"{rnd.key}/member/{i}" for i in range(store.add(f"{rnd.key}/joined", 0))])),
            "round_join_cpu_s": join_s / (world.ranks - len(lost)), "round_decide_cpu_s": decide_s}


def run(world: World) -> dict:
    rank_nodes = [world.node_of(r) for r in range(world.ranks)]
    inv, row = exchange(world, rank_nodes)
    consensus, decide_s = cpu(lambda: decide(inv.copies, job_id=JOB_ID.decode(), degrees=(TP, PP, world.dp),
                                             traces=True, allow_fresh_start=False, looked=inv.looked()))
    fetcher = Fetcher(SimpleNamespace(rank=0), None, consensus, inv)
    plans, plan_s = cpu(lambda: [fetcher.plan(k) for k in range(fetcher.rounds())])
    status = len(pickle.dumps({"got": (TIER2, 1 << 20), "next": 1, "notes": [], "fatal": None}))
    elsewhere = [sum(1 for r, cs in cands.items() if cs[0].node != rank_nodes[r]) for _, cands in plans]
    gathers = len(plans) + sum(1 for n in elsewhere if n)  # a round's local status, and one per remote attempt
    row["cpu_s"].update(consensus=decide_s, plan=plan_s)
    return {"ranks": world.ranks, "nodes": world.nodes, "dp": world.dp, "copies": len(inv.copies),
            "version": consensus.version, "end": consensus.end, "rounds": len(plans), "transfers": sum(elsewhere),
            "inventory_bytes": len(pickle.dumps(inv)), "status_bytes": gathers * world.ranks * status, **row,
            **(membership_round(world) if world.lost >= 0 else {})}


def growth(rows: list[dict], key: Callable[[dict], float]) -> str:
    """The exponent x of key ~ ranks^x between the smallest and largest world."""
    a, b = rows[0], rows[-1]
    if len(rows) < 2 or key(a) <= 0 or key(b) <= 0:
        return "-"
    return f"{math.log(key(b) / key(a)) / math.log(b['ranks'] / a['ranks']):.2f}"


def table(rows: list[dict]) -> str:
    def mib(n):
        return f"{n / 2**20:,.1f}"

    cols = [("exchange MiB/rank", lambda r: r["exchange_bytes"], mib),
            ("old exchange MiB/rank", lambda r: r["old_exchange_bytes"], mib),
            ("inventory MiB held", lambda r: r["inventory_bytes"], mib),
            ("status MiB/rank", lambda r: r["status_bytes"], mib)]
    cols += [(f"{phase} CPU s", (lambda r, p=phase: r["cpu_s"][p]), lambda v: f"{v:.3f}")
             for phase in ("unpickle", "merge", "consensus", "plan")]
    cols += [("round: decision MiB/rank", lambda r: r["round_decision_bytes"], lambda v: f"{v / 2**20:,.2f}"),
             ("round: join CPU ms", lambda r: 1000 * r["round_join_cpu_s"], lambda v: f"{v:.3f}"),
             ("round: decider CPU s", lambda r: r["round_decide_cpu_s"], lambda v: f"{v:.3f}")]
    lines = ["| ranks | " + " | ".join(name for name, _, _ in cols) + " |",
             "|---:|" + "---:|" * len(cols)]
    lines += [f"| {r['ranks']:,} | " + " | ".join(fmt(key(r)) for _, key, fmt in cols) + " |" for r in rows]
    lines.append("| growth x (~ranks^x) | " + " | ".join(growth(rows, key) for _, key, _ in cols) + " |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1024,16384,98304",
                   help=f"world sizes, each a multiple of tp*pp={TP * PP} (98304 = 100k rounded to that)")
    p.add_argument("--batch", type=int, default=5, help="steps per diff batch (checkpoint.diff.batch)")
    p.add_argument("--out-json", default=None)
    args = p.parse_args(argv)
    args.ranks = [int(x) for x in args.ranks.split(",") if x.strip()]
    bad = [w for w in args.ranks if w <= 0 or w % (TP * PP) or w // PER_NODE < 3]
    if bad:
        p.error(f"--ranks {bad}: each must be a positive multiple of {TP * PP} with at least 3 nodes of {PER_NODE}")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    rows = []
    for ranks in args.ranks:
        row = run(World(ranks, args.batch))
        print(f"{ranks:,} ranks: V={row['version']} E={row['end']}, {row['copies']:,} copies, "
              f"{row['transfers']:,} remote fetches; CPU s {json.dumps(row['cpu_s'])}", flush=True)
        rows.append(row)
    print(table(rows))
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
