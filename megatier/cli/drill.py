"""Failure drill: inject a software, node or rack failure into a job on a simulated cluster and check recovery.

    megatier-drill --nodes 2 --procs-per-node 2 --fail node --at-step 17 --compare -- \\
        model=tiny parallel.tp=2 train.iters=30 checkpoint.base_interval=20 checkpoint.diff.compression=fp32

The job runs with all three checkpoint tiers (``checkpoint=tiered`` unless the
overrides pick another checkpoint preset) on ``--nodes`` simulated nodes, one
torchrun agent each (:mod:`megatier.drill.cluster`), with its Tier-3 directory,
run directory and logs under ``--work-dir`` and its node memory (Tier-1 and
Tier-2) in /dev/shm as in a real run (:func:`megatier.drill.job.node_memory_root`; freed when the
drill exits). For each step S of ``--at-step`` the drill:

  software  arms the ``train.step_end`` crash point at S on the processes of one
            node (``--victim``, default the last): they SIGKILL themselves right after
            step S, the launcher stops the others, and the job is relaunched on the
            same nodes, Tier-1 memory intact;
  node      the same kill, then wipes the victim node's Tier-1 area (its memory is
            gone) and relaunches with a replacement node of the same name;
  rack      kills every process at S, wipes every node's Tier-1 area, relaunches.
  hang      (in-process only) SIGSTOPs one rank after S: its agent's watchdog kills it after
            10 s stopped (megatier.launcher.watchdog), so its peers' collectives fail
            before their timeout (parallel.timeout_s), and a spare takes its rank.
  stage     kills the ranks of pipeline stage ``--stage`` at S and wipes every copy
            of their units (their Tier-1 areas, their replicas on other nodes, their
            Tier-3 objects; the commit records stay, as when objects go missing), then
            relaunches with ``checkpoint.last_resort=checkfree`` (unless the overrides
            set another): the stage is rebuilt from its neighbours, not exactly.

With ``--recovery inprocess`` the nodes run ``megatier-agent`` instead of torchrun and the job is launched
once: failure k kills (software) or hangs (hang) one rank of the victim node, its last rank first, and a hot
spare on that node takes it; a node failure kills every rank of the victim node and a node of spares takes
them. The survivors keep their processes and their state: the recovery record must show them in place (zero
bytes read) or rolled back from their own Tier-1, and the lost ranks served as the class requires.

With ``--no-spare`` (node failures) no replacement arrives: the job carries on
on the surviving nodes with a smaller dp. Its restore reshards the state (the
lost node's ranks from their Tier-2 replicas on the survivors, the others from
Tier-1, nothing from Tier-3), and the job trains on to ``train.iters``. With
``--recovery inprocess`` (software or node failures, any victim node) no spare
is started and the survivors shrink dp in place; the dropped replicas' nodes
count as lost, so up to two steps may be lost.

The relaunched job recovers (its ``restore()``) and trains on to ``train.iters``.
The drill then reads each recovery record from the run's metrics.jsonl and
checks it against what the class requires:

  software  every rank served from its own node's memory (Tier-1), zero bytes from
            Tier-3, at most one step lost (one diff batch without diff.per_step);
  node      the victim node's ranks from Tier-2 (their replicas on the ring peer),
            every other rank from Tier-1, zero bytes from Tier-3, at most two steps
            lost (one diff batch without diff.per_step);
  rack      every rank from Tier-3.
  stage     a CheckFree rebuild of exactly that stage, saying it is not exact; the
            other ranks from their own Tier-1, at most one step lost.
  no spare  as node, old ranks counted on the nodes they ran on, and the
            record must say what was resharded.

With ``--compare`` it also runs the same job without a failure (in its own
directories) and compares the final ``state_digest``: with lossless diffs
(``checkpoint.diff.compression=fp32``) the two must be bit-identical; with lossy
ones the report gives the final-loss difference instead (always for a stage
failure: a rebuilt stage is not the state it lost). The exit status is 0
when every check passed, 1 when recovery did not happen as the class requires
(the report says which check failed), 2 for bad arguments. Under ``--no-spare`` the
relaunched job trains with another dp, so its final state cannot equal the
fault-free run's; ``--compare`` then runs the fault-free job to the recovery
point E and compares the layout-free canonical digest of the state there with
the one the resharded restore recorded (bit-identical with lossless diffs).
At the end the drill draws the run's pictures next to its metrics (the
figures of ``megatier-plot``: loss with the failures marked, stall, recovery
points, tier bytes).

Which S to pick: the newest base a node failure can recover from Tier-2 is the
newest whose replica finished its paced transfer (about 4/5 of a base interval
after the base), so an S late in a base interval exercises Tier-2; earlier, the
newest base is already committed on Tier-3 and the victim's ranks rightly read
it from there (the report says so).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Optional

from megatier.config import split_overrides
from megatier.drill.harness import drill
from megatier.drill.spec import CLASSES, RECOVERY_MODES, DrillError, DrillSpec


def parse_args(argv: list[str]) -> tuple[DrillSpec, Optional[str]]:
    """The drill the arguments describe, and where to write its JSON (``--json``)."""
    argv, overrides = split_overrides(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Hydra overrides for the job go after --",
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes (one torchrun agent each)")
    p.add_argument("--procs-per-node", type=int, default=2, help="training processes per node")
    p.add_argument("--fail", choices=CLASSES, required=True, help="failure class to inject")
    p.add_argument("--at-step", type=int, nargs="+", required=True, help="step(s) after which the failure strikes")
    p.add_argument("--victim", type=int, default=None, help="node index killed by a software/node failure "
                                                            "(default: the last node)")
    p.add_argument("--stage", type=int, default=None, help="stage failures: the pipeline stage whose ranks die and "
                                                           "whose units are wiped from every tier")
    p.add_argument("--corrupt", action="store_true", help="software failures: flip one byte of the victim node's "
                                                          "newest Tier-1 base before relaunching (checksum drill)")
    p.add_argument("--no-spare", action="store_true", help="node failures: no replacement node; the job carries on "
                                                            "on the survivors with a smaller dp (resharded restore; "
                                                            "in process also for software failures)")
    p.add_argument("--recovery", choices=RECOVERY_MODES, default="relaunch",
                   help="relaunch the job after each failure (torchrun), or recover in place (megatier-agent: the "
                        "survivors keep running, hot spares take the lost ranks; software, node and hang failures)")
    p.add_argument("--spares-per-node", type=int, default=None,
                   help="in-process: idle spares on every node (default: one per failure on each node; a node "
                        "failure gets a node of spares instead)")
    p.add_argument("--fail-during-recovery", action="store_true",
                   help="in-process node failures: rank 0 also dies while it rolls back, a second failure during the "
                        "recovery: the round cannot complete and the job falls back to a relaunch")
    p.add_argument("--compare", action="store_true",
                   help="also run fault-free and compare the final state_digest (with --no-spare: the canonical "
                        "digest at the recovery point)")
    p.add_argument("--work-dir", default=None, help="directory for tiers, runs and logs (default: a new temp dir)")
    p.add_argument("--json", default=None, help="write the report's data here as JSON")
    p.add_argument("--timeout-s", type=float, default=900.0, help="limit for each launch of the job")
    p.add_argument("--fail-grace-s", type=float, default=5.0,
                   help="after the victims die, seconds the other nodes get before they are stopped")
    a = p.parse_args(argv)
    work = os.path.abspath(a.work_dir or tempfile.mkdtemp(prefix="megatier_drill_"))
    spec = DrillSpec(a.fail, tuple(sorted(a.at_step)), tuple(overrides), a.nodes, a.procs_per_node, a.victim,
                     a.stage, a.corrupt, a.no_spare, a.compare, work, a.fail_grace_s, a.timeout_s,
                     recovery=a.recovery, spares_per_node=a.spares_per_node,
                     fail_in_recovery=a.fail_during_recovery)
    problem = spec.problem()
    if problem is not None:
        p.error(problem)
    return spec, a.json


def main(argv: Optional[list[str]] = None) -> int:
    spec, json_path = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        result = drill(spec)
    except DrillError as e:
        print(f"failure_drill: {e}", file=sys.stderr)
        return 1
    print(result.report)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result.data, f, indent=1)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
