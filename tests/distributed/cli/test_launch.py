"""megatier-launch: simulated nodes, their ranks and the Tier-2 ring, and the job's exit status."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(150)


def _launch(nodes: int, procs: int, *script: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MEGATIER_NODE_NAME", "GROUP_RANK"):
        env.pop(var, None)
    cmd = [sys.executable, str(REPO / "scripts" / "launch_local_cluster.py"), "--nodes", str(nodes),
           "--procs-per-node", str(procs), "--fail-grace-s", "20", "--", *script]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=140)


@pytest.mark.parametrize("nodes,procs", [(2, 2), (3, 1)])
def test_nodes_ranks_and_ring_peers(nodes, procs):
    proc = _launch(nodes, procs, "scripts/print_topology.py", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["rank"] for r in records] == list(range(nodes * procs)), proc.stdout

    assert {r["num_nodes"] for r in records} == {nodes}
    by_node: dict[str, list[dict]] = {}
    for r in records:
        by_node.setdefault(r["node"], []).append(r)
    assert sorted(by_node) == [f"node{i}" for i in range(nodes)]
    slot = {}
    for name, members in by_node.items():
        assert {r["node_index"] for r in members} == {int(name[4:])}, members
        assert sorted(r["local_rank"] for r in members) == list(range(procs)), members
        ranks = sorted(r["rank"] for r in members)
        # An agent's processes get a contiguous block of ranks, so tp groups stay inside a node.
        assert ranks == list(range(ranks[0], ranks[0] + procs)), members
        slot.update({(int(name[4:]), r["local_rank"]): r["rank"] for r in members})

    for r in records:
        n = r["node_index"]
        assert r["replica_holder"] == slot[((n + 1) % nodes, r["local_rank"])], r
        assert r["replica_owner"] == slot[((n - 1) % nodes, r["local_rank"])], r


def test_failing_job_fails_the_launcher():
    # tp=3 cannot divide a world of 2: every process exits with an error, so must the launcher.
    proc = _launch(2, 1, "scripts/print_topology.py", "--tp", "3")
    assert proc.returncode != 0
    assert "not divisible by parallel.tp=3" in proc.stderr
