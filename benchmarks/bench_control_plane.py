"""Recovery's control plane at 1k to 100k ranks, simulated in one process on a synthetic inventory.

When a job recovers, every rank sends its share of its node's listing to rank
0; rank 0 merges the inventory, agrees on the base V and the end E, and sends
each rank its plan (the chains and copies of the units it fetches); each rank
then plans its own rounds of the cascade. Those steps are pure functions of
what was exchanged, so one process can run them for a world it does not have.
This script builds the inventory such a world leaves behind and runs
MegaTier's own functions on it:

  world      tp 8 (one node of 8 ranks), pp 16, dp the rest; every rank has 2
             bases (steps 0 and 50) and a 50-step chain after the newer one
             (diff batches of --batch steps) in its node's memory (Tier-1) and
             in its ring successor's (Tier-2); Tier-3 holds the bases and
             every batch but the newest (its upload was in flight)
  failure    one node lost: its memory is gone (its ranks' own copies and the
             replicas it held); a spare node with empty memory runs its ranks

Figures:

  rank 0     bytes it receives (the node names, an all-gather, and every
             rank's share, a gather: torch pads every item to the largest);
             what it holds (the merged inventory and the plans); its CPU to
             unpickle, merge, decide (consensus) and cut and pickle the plans
  other      a rank other than 0 (one of the spare node's): bytes it receives
             (the node names and its plan: the scatter pads every plan to the
             largest), what it holds (its plan), its CPU to unpickle its plan
             and plan its rounds (Fetcher.plan)
  every      what every rank holds whatever the world: the node names and
             where each rank's units came from (the record's)
  status     the status gathers of the cascade's rounds (bytes per rank)
  before     what every rank received when each derived the consensus itself
             (an all-gather of the shares and a broadcast of Tier-3's listing)
  round      in-process recovery's membership round on an in-memory store:
             every survivor joins, the spare node's ranks join as spares, the
             lost node's processes are reported dead; the deciding survivor
             reads the member list once and assigns the ranks (its CPU); every
             member reads the decision (bytes per rank)

A second table is the decision from per-node summaries that restore() takes in
the common recovery instead of rank 0's (megatier/checkpoint/recover/by_node.py,
summary.py and routing.py, run by benchmarks/control_plane_nodes.py): the
decider's and a node leader's bytes, peak memory and CPU, Tier-3's record
headers on rank 0 and record parts on a leader, and the growth of each by
ranks and by nodes (8 ranks a node: the two fits coincide). Up to 4,096 ranks
every plan cut that way is checked equal to rank 0's.

Figures are CPU seconds of this one thread (time.process_time) and bytes; they
do not depend on the machine's load.

    python benchmarks/bench_control_plane.py                      # 1k, 16k, 100k ranks (~10 min, ~5 GiB)
    python benchmarks/bench_control_plane.py --ranks 1024,2048 --out-json cp.json
"""
from __future__ import annotations

import argparse
import json
import math
import pickle
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.control_plane_nodes import simulate  # noqa: E402
from benchmarks.control_plane_world import (  # noqa: E402
    JOB_ID,
    PER_NODE,
    PP,
    TIERS,
    TP,
    World,
    cpu,
    node_listings,
    padded,
    stamps,
)
from megatier.checkpoint.recover.cascade import Fetcher  # noqa: E402
from megatier.checkpoint.recover.consensus import cascade, decide  # noqa: E402
from megatier.checkpoint.recover.inventory import Inventory, merge, share_of  # noqa: E402
from megatier.checkpoint.recover.plan import RankPlan, cut  # noqa: E402
from megatier.checkpoint.recover.record import Sources  # noqa: E402
from megatier.checkpoint.tiers.base import TIER2, TIER3, Copy, Listing  # noqa: E402
from megatier.parallel.assignment import Member  # noqa: E402
from megatier.parallel.membership import MembershipRound  # noqa: E402

CHECK_UP_TO = 4096  # worlds where every plan cut from summaries is checked against rank 0's (all in memory)


def exchange(world: World, rank_nodes: list[str]) -> tuple[Inventory, dict]:
    """Every rank's share pickled as it sends it to rank 0, and rank 0's side: unpickle and merge (it lists
    Tier-3 itself). ``old`` figures are the all-gather every rank received before rank 0 decided alone."""
    names = pickle.dumps(rank_nodes[0])
    remote = {TIER3: Listing(copies=[Copy(s, TIER3, None) for r in range(world.ranks)
                                     for s in stamps(world, r, world.units(tier3=True))], traces=True)}
    items, build_s = [], 0.0
    for node in range(world.nodes):
        listings, seconds = cpu(lambda: node_listings(world, node))
        build_s += seconds
        for i in range(PER_NODE):
            shares = {label: share_of(listing, i, PER_NODE) for label, listing in listings.items()}
            items.append(pickle.dumps({"shares": shares, "fatal": None}))
    received, unpickle_s = cpu(lambda: [pickle.loads(b)["shares"] for b in items])
    inv, merge_s = cpu(lambda: merge(rank_nodes, received, remote, TIERS))
    names_bytes = padded([len(names)] * world.ranks)
    job_bytes = len(pickle.dumps(remote))
    return inv, {"names_bytes": names_bytes, "rank0_receives": names_bytes + padded([len(b) for b in items]),
                 "old_receives": names_bytes + padded([len(b) for b in items]) + job_bytes,
                 "cpu_s": {"listing": build_s / world.nodes, "unpickle": unpickle_s, "merge": merge_s}}


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
    degrees = (TP, PP, world.dp)
    consensus, decide_s = cpu(lambda: decide(inv.copies, job_id=JOB_ID.decode(), degrees=degrees, traces=True,
                                             allow_fresh_start=False, looked=inv.looked()))
    plans, cut_s = cpu(lambda: cut(consensus, rank_nodes, degrees, RankPlan(None)))
    blobs, pickle_s = cpu(lambda: [pickle.dumps(p) for p in plans])
    # A rank other than 0: the spare node's first rank (its units come from other nodes), and its rounds' plans.
    other = max(world.lost, 1) * PER_NODE
    mine, unpickle_s = cpu(lambda: pickle.loads(blobs[other]))
    fetcher = Fetcher(SimpleNamespace(rank=other), SimpleNamespace(node=rank_nodes[other]), mine.consensus,
                      rank_nodes)
    fetcher.owner = mine.passes[0]
    own, own_s = cpu(lambda: [fetcher.plan(k) for k in range(mine.rounds[0])])
    remote, sources = [], Sources()  # the transfers; where each rank's units come from, as every rank folds it
    for r, chain in consensus.chains.items():
        for k, pid in enumerate(chain):
            first = cascade(consensus.copies[(r, pid)], rank_nodes[r])[0]
            sources.add(r, k == 0, first.reach(rank_nodes[r]))
            if first.node != rank_nodes[r]:
                remote.append(k)
    attempts = len(set(remote))  # a round in which some rank's first copy is on another node: one remote attempt
    status = max(len(pickle.dumps({"got": (TIER2, 1 << 20, other, True), "notes": [], "fatal": None})),
                 len(pickle.dumps({"got": None, "notes": [], "fatal": None, "ask": 8})))
    gathers = mine.rounds[0] + attempts  # a round's local status, and one remote attempt
    plan_bytes = padded([len(b) for b in blobs])
    row["cpu_s"].update(consensus=decide_s, plans=cut_s + pickle_s, other=unpickle_s + own_s)
    out = {"ranks": world.ranks, "nodes": world.nodes, "dp": world.dp, "copies": len(inv.copies),
            "version": consensus.version, "end": consensus.end, "rounds": mine.rounds[0], "transfers": len(remote),
            "rank0_holds": len(pickle.dumps(inv)) + sum(len(b) for b in blobs), "other_holds": len(blobs[other]),
            "every_holds": len(pickle.dumps(rank_nodes)) + len(pickle.dumps(sources)),
            "other_receives": row["names_bytes"] + plan_bytes // world.ranks, "rank0_sends": plan_bytes,
            "status_bytes": gathers * world.ranks * status, **row,
            **(membership_round(world) if world.lost >= 0 else {})}
    reference = blobs if world.ranks <= CHECK_UP_TO else None  # every plan from summaries must equal rank 0's
    inv = plans = consensus = blobs = mine = fetcher = None  # free the whole inventory before the new path
    return {**out, **simulate(world, JOB_ID.decode(), rank_nodes, reference)}


def growth(rows: list[dict], key: Callable[[dict], float], by: str = "ranks") -> str:
    """The exponent x of key ~ by^x (``by``: ranks or nodes) between the smallest and largest world."""
    a, b = rows[0], rows[-1]
    if len(rows) < 2 or key(a) <= 0 or key(b) <= 0:
        return "-"
    return f"{math.log(key(b) / key(a)) / math.log(b[by] / a[by]):.2f}"


def table_nodes(rows: list[dict]) -> str:
    """The decision from summaries (benchmarks/control_plane_nodes.py), with its growth by ranks and by nodes."""
    def mib(n):
        return f"{n / 2**20:,.2f}"

    cols = [("decider receives MiB", lambda r: r["new_decider_receives"], mib),
            ("decider peak MiB", lambda r: r["new_decider_peak"], mib),
            ("decider CPU s", lambda r: r["new_decider_cpu_s"], lambda v: f"{v:.3f}"),
            ("decider wall s", lambda r: r["new_decider_wall_s"], lambda v: f"{v:.3f}"),
            ("holdings read", lambda r: r["new_holdings"], lambda v: f"{v:,}"),
            ("decider sends MiB", lambda r: r["new_point_bytes"], mib),
            ("leader receives KiB", lambda r: r["new_leader_receives"], lambda v: f"{v / 1024:,.1f}"),
            ("leader peak MiB", lambda r: r["new_leader_peak"], mib),
            ("leader CPU ms", lambda r: 1000 * r["new_leader_cpu_s"], lambda v: f"{v:.1f}"),
            ("critical path CPU s", lambda r: r["new_modeled_s"], lambda v: f"{v:.3f}"),
            ("Tier-3 headers on rank 0: CPU s", lambda r: r["t3_headers_cpu_s"], lambda v: f"{v:.3f}"),
            ("their KiB", lambda r: r["t3_header_bytes"], lambda v: f"{v / 1024:,.1f}"),
            ("leader's Tier-3 parts: CPU ms", lambda r: 1000 * r["t3_leader_read_s"], lambda v: f"{v:.1f}"),
            ("whole records on rank 0: CPU s", lambda r: r["t3_whole_cpu_s"], lambda v: f"{v:.3f}"),
            ("its peak MiB", lambda r: r["t3_whole_peak"], mib)]
    lines = ["| ranks | nodes | " + " | ".join(name for name, _, _ in cols) + " |",
             "|---:|---:|" + "---:|" * len(cols)]
    lines += [f"| {r['ranks']:,} | {r['nodes']:,} | " + " | ".join(fmt(key(r)) for _, key, fmt in cols) + " |"
              for r in rows]
    for by in ("ranks", "nodes"):
        lines.append(f"| growth x (~{by}^x) | | " + " | ".join(growth(rows, key, by) for _, key, _ in cols) + " |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    def mib(n):
        return f"{n / 2**20:,.2f}"

    def sec(v):
        return f"{v:.3f}"

    cols = [("rank 0 receives MiB", lambda r: r["rank0_receives"], mib),
            ("rank 0 holds MiB", lambda r: r["rank0_holds"], mib),
            ("rank 0 CPU s", lambda r: sum(r["cpu_s"][p] for p in ("unpickle", "merge", "consensus", "plans")), sec),
            ("other rank receives MiB", lambda r: r["other_receives"], mib),
            ("other rank holds KiB", lambda r: r["other_holds"], lambda v: f"{v / 1024:,.1f}"),
            ("other rank CPU ms", lambda r: 1000 * r["cpu_s"]["other"], lambda v: f"{v:.2f}"),
            ("every rank holds MiB", lambda r: r["every_holds"], mib),
            ("status MiB/rank", lambda r: r["status_bytes"], mib),
            ("before: every rank received MiB", lambda r: r["old_receives"], mib)]
    cols += [("round: decision MiB/rank", lambda r: r["round_decision_bytes"], mib),
             ("round: decider CPU s", lambda r: r["round_decide_cpu_s"], sec)]
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
        checked = "not checked" if row["new_mismatched"] is None else \
            f"{ranks - len(row['new_mismatched']):,} of {ranks:,} plans equal to rank 0's"
        print(f"  from summaries: V={row['new_version']} E={row['new_end']}, {row['new_holdings']:,} holdings, "
              f"{row['new_spans']:,} spans; {checked}", flush=True)
        rows.append(row)
    print(table(rows))
    print()
    print("Decision from per-node summaries:")
    print(table_nodes(rows))
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
