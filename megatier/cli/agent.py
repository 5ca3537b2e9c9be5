r"""megatier-agent: one node's agent for in-process recovery (survivors keep running, hot spares wait).

    megatier-agent --serve-store 29500                                   (on the host that keeps the store)
    megatier-agent --nodes 2 --node-rank 0 --nproc-per-node 8 --spares-per-node 1 \
        --store host0:29500 --run-id job1 -- -m megatier.train model=small recovery.mode=inprocess

Unlike torchrun's agent it leaves a node's other processes running when one fails, reports the failed one to
the membership store, and starts ``--spares-per-node`` idle processes that take a lost rank
(:mod:`megatier.launcher.agent`; docs/checkpointing.md#in-process-recovery says what a cluster needs).
``--serve-store PORT`` runs the membership store in this process; on a real cluster run it on a host that no
failure of a training node takes down. Exit status: 0 when every failed process was replaced and the job ended
well, else the worst status of the node's processes.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Optional

from megatier.launcher.agent import NodeAgent, serve_store
from megatier.launcher.watchdog import DEFAULT_HANG_TIMEOUT_S


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve-store", type=int, default=None, metavar="PORT",
                        help="serve the membership store on PORT until interrupted (and run no node)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes that run ranks")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index among them")
    parser.add_argument("--node-name", default=None, help="this node's name (default node<node-rank>)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="ranks on this node (0: a node of spares)")
    parser.add_argument("--spares-per-node", type=int, default=0, help="idle hot spares on this node")
    parser.add_argument("--store", default=None, help="host:port of the membership store")
    parser.add_argument("--run-id", default="job", help="the launch's id, the same on every node")
    parser.add_argument("--respawn", action="store_true",
                        help="start a new spare in place of each process that fails (a long job keeps its spares)")
    parser.add_argument("--hang-timeout-s", type=float, default=DEFAULT_HANG_TIMEOUT_S,
                        help="kill a process of this node that has been stopped (SIGSTOP) this long, so the "
                             "job recovers without waiting for the collective's timeout (0: never)")
    args = parser.parse_args(argv[:split])
    script = argv[split + 1:]
    if args.serve_store is None and (args.store is None or not script):
        parser.error("give --store host:port and the script after -- (or --serve-store PORT)")
    return args, script


def main(argv: Optional[list[str]] = None) -> int:
    args, script = parse_args(sys.argv[1:] if argv is None else argv)
    if args.serve_store is not None:
        store = serve_store(args.serve_store)
        print(f"megatier-agent: membership store on port {store.port}", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0
    try:
        agent = NodeAgent(script, node=args.node_name or f"node{args.node_rank}", node_rank=args.node_rank,
                          nodes=args.nodes, procs=args.nproc_per_node, spares=args.spares_per_node,
                          store=args.store, run_id=args.run_id, respawn=args.respawn,
                          hang_timeout_s=args.hang_timeout_s)
    except ValueError as e:  # counts or a timeout out of range: one line, as parse_args says it
        print(f"megatier-agent: {e}", file=sys.stderr)
        return 2

    def forward(signum, _frame):  # Ctrl-C or SIGTERM reaches every process of the node once
        agent.stop(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
