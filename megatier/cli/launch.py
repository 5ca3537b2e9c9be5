"""Simulate a multi-node cluster on one host: one torchrun agent per simulated node.

    megatier-launch --nodes 2 --procs-per-node 4 -- \\
        -m megatier.train model=tiny parallel.tp=2 parallel.pp=2 train.iters=20
    megatier-launch --nodes 2 --procs-per-node 1 -- pretrain_gpt.py model=tiny

What runs after ``--`` is what torchrun runs (a script, or ``-m module``) with its arguments; each node's
processes get MEGATIER_NODE_NAME=node{i} (:mod:`megatier.drill.cluster`). Exit status: the worst of the agents'
(a signal death counts as 128 + signal). Ctrl-C or SIGTERM is passed to every agent and its workers, which stop
cleanly after their step, as under megatier-run; a second one stops them at once.

With ``--recovery inprocess`` each node runs ``megatier-agent`` instead of torchrun's agent: a failed process
leaves the others running, ``--spares-per-node`` idle spares wait on every node and ``--spare-nodes`` nodes hold
only spares, and this process serves the membership store (docs/checkpointing.md#in-process-recovery).
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Optional

from megatier.drill.cluster import LocalCluster
from megatier.launcher.watchdog import DEFAULT_HANG_TIMEOUT_S
from megatier.training.interrupt import REPEAT_S


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
    parser.add_argument("--respawn", action="store_true",
                        help="in-process: each agent starts a new spare in place of every process that fails")
    parser.add_argument("--hang-timeout-s", type=float, default=None,
                        help="in-process: an agent kills a process that has been stopped this long (default "
                             f"{DEFAULT_HANG_TIMEOUT_S:g}; 0: never)")
    args, script = parser.parse_args(argv[:split]), argv[split + 1:]
    if not script:
        parser.error("no job to run: put the job after --, e.g. -- pretrain_gpt.py model=tiny")
    return args, script


def main(argv: Optional[list[str]] = None) -> int:
    args, script_args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cluster = LocalCluster(args.nodes, args.procs_per_node, script_args, port=args.port,
                               max_restarts=args.max_restarts, recovery=args.recovery,
                               spares_per_node=args.spares_per_node, spare_nodes=args.spare_nodes,
                               respawn=args.respawn, hang_timeout_s=args.hang_timeout_s)
    except ValueError as e:
        print(f"megatier-launch: {e}", file=sys.stderr)
        return 2

    # Installed explicitly: a launcher started in the background inherits SIGINT ignored.
    first = _ForwardOnce(cluster)
    signal.signal(signal.SIGINT, first)
    signal.signal(signal.SIGTERM, first)
    try:
        cluster.start()
        return cluster.wait(fail_grace_s=args.fail_grace_s)
    except KeyboardInterrupt:
        print("megatier-launch: interrupted again; stopping all nodes now", file=sys.stderr)
        cluster.stop()
        return 128 + (first.signal or signal.SIGINT)


class _ForwardOnce:
    """The first Ctrl-C or SIGTERM goes on to every node, whose workers stop cleanly after their step (their rank 0
    says where to resume; the launch ends with their 130 or 143); a second one later than REPEAT_S (not the same
    press, which a scheduler also delivers to every process) stops every node at once."""

    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster
        self.signal: Optional[signal.Signals] = None
        self.at = 0.0

    def __call__(self, signum, _frame) -> None:
        if self.signal is None:
            self.signal, self.at = signal.Signals(signum), time.monotonic()
            self.cluster.forward(self.signal)
        elif time.monotonic() - self.at > REPEAT_S:
            raise KeyboardInterrupt(signal.Signals(signum).name)


if __name__ == "__main__":
    sys.exit(main())
