"""Node memory filed under another node name: adopt it, or say why not.

A node's memory is kept under ``<local.root>/<job_id>/<node name>/``. The name is the hostname unless
``MEGATIER_NODE_NAME`` sets it (:func:`megatier.parallel.state.node_identity`), so a relaunch through
another launcher finds its area again. A name can still change between launches (an older MegaTier named
nodes by torchrun's ``GROUP_RANK``; a user sets ``MEGATIER_NODE_NAME`` differently); the area is then an
*orphan*: a node directory of the job that no node of this launch is named after.

Before any tier opens, the nodes agree (one gather) on what to do with the orphans. A node adopts an
orphan (renames the directory to its own name; nothing is copied or lost) when the orphan is the only one
it sees, no other node sees it (simulated nodes share one root: there an orphan could be any of theirs),
and the node's own area holds nothing yet. Every other orphan is left in place and reported: the
inventory then counts the job as having traces, so a launch that finds no recovery point stops and names
the directory instead of starting fresh over it.
"""
from __future__ import annotations

import logging
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence

from megatier.checkpoint.comm import CheckpointComm

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AreaView:
    """What one node's server sees under the job's directory of its ``local.root``."""

    node: str
    orphans: tuple[str, ...]  # node directories no node of this launch is named after
    own_used: bool  # the node's own directory holds anything


def job_dir(root: str, job_id: str) -> str:
    return os.path.join(os.path.abspath(os.path.expanduser(root)), job_id)


def look(root: str, job_id: str, node: str, current: Sequence[str]) -> AreaView:
    """This node's view of ``root`` for the job: its orphans and whether its own area is in use."""
    base = job_dir(root, job_id)
    names = sorted(n for n in os.listdir(base) if os.path.isdir(os.path.join(base, n))) if os.path.isdir(base) else []
    own = os.path.join(base, node)
    used = os.path.isdir(own) and any(os.scandir(own))
    return AreaView(node, tuple(n for n in names if n not in set(current)), used)


def adoptions(views: Sequence[AreaView]) -> tuple[dict[str, str], list[str]]:
    """Pure decision from every node server's view: (node -> orphan it adopts, orphans left in place)."""
    seen_by: dict[str, set[str]] = defaultdict(set)
    for v in views:
        for orphan in v.orphans:
            seen_by[orphan].add(v.node)
    adopt = {}
    for v in views:
        if len(v.orphans) == 1 and seen_by[v.orphans[0]] == {v.node} and not v.own_used:
            adopt[v.node] = v.orphans[0]
    left = sorted(o for o in seen_by if o not in adopt.values())
    return adopt, left


def adopt_orphans(comm: CheckpointComm, root: str, job_id: str, node: str, nodes: Sequence[str], *,
                  server: bool, announce: bool = True) -> list[str]:
    """Collective: adopt what :func:`adoptions` allows (the node's ``server`` rank renames), return the orphans
    left in place, which rank 0 reports when ``announce`` (not in a world an in-process recovery re-formed:
    there they are the areas of this launch's nodes that no longer hold a rank). Every rank calls it before
    opening node memory."""
    view: Optional[AreaView] = None
    fatal = None
    if server:
        try:
            view = look(root, job_id, node, nodes)
        except OSError as e:
            fatal = f"cannot list {job_dir(root, job_id)} on {node}: {e}"
    views = comm.gather({"view": view, "fatal": fatal}, what="the node-memory name check")
    problems = [v["fatal"] for v in views if v["fatal"]]
    if problems:
        raise RuntimeError("; ".join(problems))
    adopt, left = adoptions([v["view"] for v in views if v["view"] is not None])
    done = None
    if server and node in adopt:
        base = job_dir(root, job_id)
        try:
            os.replace(os.path.join(base, adopt[node]), os.path.join(base, node))
            log.warning("node memory of job %r was filed under node name %r; this launch names the node %r and "
                        "uses it (renamed %s)", job_id, adopt[node], node, os.path.join(base, adopt[node]))
        except OSError as e:
            done = f"cannot rename {adopt[node]} to {node} under {base}: {e}"
    statuses = comm.gather(done, what="the node-memory adoption")
    failed = [s for s in statuses if s]
    if failed:
        raise RuntimeError("; ".join(failed))
    if left and announce and comm.rank == 0:
        log.warning("node memory of job %r under %s is filed under node name(s) %s, which no node of this launch "
                    "has; it is left in place. If it is this machine's, relaunch with MEGATIER_NODE_NAME set to "
                    "that name", job_id, job_dir(root, job_id), ", ".join(left))
    return left
