"""What a failure drill does, as one typed value: the cluster, the failure, where it lives; and its checks."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

CLASSES = ("software", "node", "rack", "stage", "hang")
RECOVERY_MODES = ("relaunch", "inprocess")


class DrillError(RuntimeError):
    """A drill that cannot run or finish as asked (bad settings, a work directory in use, a failed reference);
    the message is one line."""


@dataclass(frozen=True)
class LaunchSettings:
    """How the job is launched on the simulated cluster: its shape and how long each launch may take."""

    nodes: int
    procs_per_node: int
    fail_grace_s: float = 5.0  # after the victims die, seconds the other nodes get before they are stopped
    timeout_s: float = 900.0  # limit of each launch
    recovery: str = "relaunch"  # inprocess: megatier-agent per node, survivors re-form the job with spares
    spares_per_node: int = 0
    spare_nodes: int = 0  # nodes of spares only (procs_per_node spares each)

    def on(self, nodes: int) -> "LaunchSettings":
        return LaunchSettings(nodes, self.procs_per_node, self.fail_grace_s, self.timeout_s, self.recovery,
                              self.spares_per_node, self.spare_nodes)


@dataclass(frozen=True)
class DrillSpec:
    """One drill (``megatier-drill``'s arguments); :meth:`problem` says what is wrong with it, if anything."""

    fail: str
    at_steps: tuple[int, ...]
    overrides: tuple[str, ...] = ()
    nodes: int = 2
    procs_per_node: int = 2
    victim: Optional[int] = None  # default: the last node
    stage: Optional[int] = None
    corrupt: bool = False
    no_spare: bool = False
    compare: bool = False
    work_dir: str = ""
    fail_grace_s: float = 5.0
    timeout_s: float = 900.0
    extra: tuple[str, ...] = field(default=())  # overrides before the user's (the class's defaults)
    recovery: str = "relaunch"
    spares_per_node: Optional[int] = None  # in-process: default one per failure on the victim node (none for node)
    fail_in_recovery: bool = False  # in-process node drill: rank 0 also dies in the recovery's rollback

    @property
    def victim_node(self) -> int:
        return self.nodes - 1 if self.victim is None else self.victim

    @property
    def inprocess(self) -> bool:
        return self.recovery == "inprocess"

    @property
    def launch(self) -> LaunchSettings:
        if not self.inprocess:
            return LaunchSettings(self.nodes, self.procs_per_node, self.fail_grace_s, self.timeout_s)
        if self.no_spare:  # the round shrinks dp
            return LaunchSettings(self.nodes, self.procs_per_node, self.fail_grace_s, self.timeout_s, self.recovery)
        spares = self.spares_per_node
        if spares is None:  # a failure during the recovery kills rank 0 too: a spare on its node takes it
            spares = 0 if self.fail == "node" and not self.fail_in_recovery else len(self.at_steps)
        return LaunchSettings(self.nodes, self.procs_per_node, self.fail_grace_s, self.timeout_s, self.recovery,
                              spares, 1 if self.fail == "node" else 0)

    def victim_ranks(self, k: int) -> list[int]:
        """In-process drills (ranks are node-major there): the ranks failure ``k`` kills: the victim node's last
        rank for the first, the one before it for the second, ...; every rank of the node for a node failure.
        Without spares the second kills rank 0 of the shrunk job, which a survivor of the dropped replica takes."""
        if self.no_spare and k:
            return [0]
        first = self.victim_node * self.procs_per_node
        if self.fail == "node":
            return list(range(first, first + self.procs_per_node))
        return [first + (self.procs_per_node - 1 - k) % self.procs_per_node]

    def victims(self) -> list[int]:
        """The node indices the failure kills (a stage failure kills ranks, no node)."""
        if self.fail == "rack":
            return list(range(self.nodes))
        return [] if self.fail == "stage" else [self.victim_node]

    def armed_node(self, k: int) -> int:
        """The node whose processes arm failure ``k`` (in-process drills): the victim's, but the second failure
        without spares is on the node after it, which holds the shrunk job's rank 0."""
        return (self.victim_node + 1) % self.nodes if self.no_spare and k else self.victim_node

    def problem(self) -> Optional[str]:
        """Why this drill cannot run (one line), or None."""
        if self.fail not in CLASSES:
            return f"--fail {self.fail}: choose one of {', '.join(CLASSES)}"
        if self.recovery not in RECOVERY_MODES:
            return f"--recovery {self.recovery}: choose one of {', '.join(RECOVERY_MODES)}"
        if self.inprocess and self.fail not in ("software", "node", "hang"):
            return f"--recovery inprocess drills software, node and hang failures, not {self.fail}"
        if self.fail == "hang" and not self.inprocess:
            return "--fail hang goes with --recovery inprocess (a relaunch ends a hung job by its timeouts)"
        if self.inprocess and self.corrupt:
            return "--corrupt goes with --recovery relaunch"
        if self.no_spare and self.spares_per_node:
            return "--no-spare runs without spares: drop --spares-per-node"
        if self.inprocess and self.fail == "node" and len(self.at_steps) != 1:
            return "an in-process node drill takes one --at-step (one spare node)"
        if not self.inprocess and self.spares_per_node:
            return "--spares-per-node goes with --recovery inprocess"
        if self.fail_in_recovery and not (self.inprocess and self.fail == "node" and self.victim_node != 0):
            return ("--fail-during-recovery goes with --recovery inprocess --fail node and a victim other than node 0 "
                    "(rank 0 dies while it rolls back from its own node's memory)")
        if self.nodes < 1 or self.procs_per_node < 1:
            return "--nodes and --procs-per-node must be >= 1"
        if not 0 <= self.victim_node < self.nodes:
            return f"--victim {self.victim_node} is not a node index in [0, {self.nodes})"
        if self.fail == "node" and self.nodes < 2:
            return "a node failure needs --nodes >= 2: the lost node's replicas live on its ring peer"
        if self.no_spare and self.inprocess and not (self.fail == "node" and len(self.at_steps) == 1 or
                                                     self.fail == "software" and len(self.at_steps) <= 2):
            return ("--no-spare --recovery inprocess goes with --fail node and one --at-step, or --fail software "
                    "and up to two")
        if self.no_spare and not self.inprocess and (self.fail != "node" or len(self.at_steps) != 1 or
                                                     self.victim_node != self.nodes - 1):
            return ("--no-spare goes with --fail node, one --at-step and the last node as the victim (the survivors "
                    "keep their node names)")
        if (self.fail == "stage") != (self.stage is not None):
            return "--stage goes with --fail stage, and --fail stage needs --stage"
        if self.corrupt and self.fail != "software":
            return "--corrupt goes with --fail software (node and rack failures wipe the Tier-1 copy anyway)"
        if not self.at_steps or len(set(self.at_steps)) != len(self.at_steps) or min(self.at_steps) < 1:
            return f"--at-step {list(self.at_steps)}: give distinct steps >= 1"
        return None
