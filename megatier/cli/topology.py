"""Print the parallel layout as every rank sees it: node, local rank, coordinates, ring peers.

    torchrun --nproc-per-node 4 scripts/print_topology.py --tp 2
    megatier-launch --nodes 2 --procs-per-node 2 -- scripts/print_topology.py --json

Rank 0 prints one line per rank in rank order (ParallelState.describe(), or a
JSON object with --json), so a launcher's node assignment can be checked.
"""
from __future__ import annotations

import argparse
import json
from typing import Optional

import torch
import torch.distributed as dist

from megatier.parallel.state import ParallelState, build_parallel_state, init_process_group


def topology_record(ps: ParallelState) -> dict:
    """This rank's place in the layout and the cluster, as plain values."""
    return {
        "rank": ps.rank, "world_size": ps.world_size, "tp_rank": ps.tp_rank, "dp_rank": ps.dp_rank,
        "pp_rank": ps.pp_rank, "node": ps.node_name, "node_index": ps.node_index, "num_nodes": ps.num_nodes,
        "local_rank": ps.local_rank, "replica_holder": ps.replica_holder_rank, "replica_owner": ps.replica_owner_rank,
        "describe": ps.describe(),
    }


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--json", action="store_true", help="one JSON object per rank instead of text")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    init_process_group("gloo", args.timeout_s)
    ps = build_parallel_state(args.tp, args.pp, args.timeout_s, torch.device("cpu"))
    records: list = [None] * ps.world_size
    dist.all_gather_object(records, topology_record(ps), group=ps.checkpoint_group)
    if ps.rank == 0:
        for r in records:
            print(json.dumps(r) if args.json else r["describe"], flush=True)
    dist.barrier(group=ps.checkpoint_group)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
