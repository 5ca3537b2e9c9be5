"""Simulate a multi-node cluster on one host: one torchrun agent per simulated node.

    megatier-launch --nodes 2 --procs-per-node 4 -- \\
        -m megatier.train model=tiny parallel.tp=2 parallel.pp=2 train.iters=20
    megatier-launch --nodes 2 --procs-per-node 1 -- pretrain_gpt.py model=tiny

What runs after ``--`` is what torchrun runs (a script, or ``-m module``) with its arguments; each node's
processes get MEGATIER_NODE_NAME=node{i} (:mod:`megatier.drill.cluster`). Exit status: the worst of the agents'
(a signal death counts as 128 + signal). Ctrl-C or SIGTERM stops every agent and its workers.

With ``--recovery inprocess`` each node runs ``megatier-agent`` instead of torchrun's agent: a failed process
leaves the others running, ``--spares-per-node`` idle spares wait on every node and ``--spare-nodes`` nodes hold
only spares, and this process serves the membership store (docs/checkpointing.md#in-process-recovery).
"""
from __future__ import annotations

import argparse
import signal
import sys
from typing import Optional

from megatier.drill.cluster import LocalCluster


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's options (before ``--``) and the job's command (after it). --help works without ``--``;
    a missing ``--`` or job is argparse's usage error (exit 2), naming the fix."""
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="megatier-launch", description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s --nodes N --procs-per-node M [options] -- SCRIPT [ARGS...]")
    parser.add_argument("--nodes", type=int, required=True, help="simulated nodes (one torchrun agent each)")
    parser.add_argument("--procs-per-node", type=int, required=True, help="training processes per node")
    parser.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    parser.add_argument("--max-restarts", type=int, default=0, help="torchrun worker-group restarts per agent")
    parser.add_argument("--fail-grace-s", type=float, default=30.0,
                        help="after one agent fails, seconds the others get to finish before they are stopped")
    parser.add_argument("--recovery", choices=("relaunch", "inprocess"), default="relaunch",
                        help="inprocess: megatier-agent per node; survivors keep running and spares take lost ranks")
    parser.add_argument("--spares-per-node", type=int, default=0, help="in-process: idle spares on every node")
    parser.add_argument("--spare-nodes", type=int, default=0, help="in-process: extra nodes holding only spares")
    args, script = parser.parse_args(argv[:split]), argv[split + 1:]
    if not script:
        parser.error("no job to run: put the job after --, e.g. -- pretrain_gpt.py model=tiny")
    return args, script


def main(argv: Optional[list[str]] = None) -> int:
    args, script_args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cluster = LocalCluster(args.nodes, args.procs_per_node, script_args, port=args.port,
                               max_restarts=args.max_restarts, recovery=args.recovery,
                               spares_per_node=args.spares_per_node, spare_nodes=args.spare_nodes)
    except ValueError as e:
        print(f"megatier-launch: {e}", file=sys.stderr)
        return 2

    def interrupt(signum, _frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    # Installed explicitly: a launcher started in the background inherits SIGINT ignored.
    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    try:
        cluster.start()
        return cluster.wait(fail_grace_s=args.fail_grace_s)
    except KeyboardInterrupt:
        print("launch_local_cluster: interrupted; stopping all nodes", file=sys.stderr)
        cluster.stop()
        return 130


if __name__ == "__main__":
    sys.exit(main())
