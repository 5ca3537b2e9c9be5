"""The size planner against what a short real run holds: 2 simulated nodes x 1 process (dp=2, ZeRO-1 shards),
tiny GPT, a base every 10 steps, adaptive diffs with top-k on segments from 2000 elements (both codecs in use).

Tolerances: a base is exact up to the digits of its version in the metadata (16 bytes); a diff batch or step
unit holds top-k records whose kept count a sampled threshold sets (between half and twice the planned target):
each within 20% of the plan, their mean within 10%.
"""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

import pytest

from megatier.checkpoint.format.units import BASE, DIFF, STEP
from megatier.checkpoint.offline.plan import Cluster, plan
from megatier.checkpoint.tiers.node_memory import NodeMemory
from megatier.config import compose_config
from megatier.drill.cluster import LocalCluster
from megatier.drill.job import trainer_command

JOB = "planned"


def _overrides(work: Path, corpus_prefix: str) -> list[str]:
    return ["model=tiny", f"data.prefix={corpus_prefix}", "train.iters=24", "train.global_batch_size=4",
            "train.micro_batch_size=2", "data.seq_len=64", "checkpoint=tiered", "checkpoint.base_interval=10",
            "checkpoint.diff.small_threshold=2000", "logging.wandb.mode=disabled", "logging.progress=false",
            "parallel.timeout_s=30", f"checkpoint.job_id={JOB}", f"checkpoint.local.root={work}/shm",
            f"checkpoint.remote.url={work}/remote", f"logging.run_dir={work}/run"]


def _held(work: Path) -> dict[str, dict[int, dict[str, list[int]]]]:
    """node -> owner rank -> unit kind -> payload sizes of every complete unit in that node's memory."""
    out: dict = {}
    for node in NodeMemory.nodes(str(work / "shm"), JOB):
        memory = NodeMemory(str(work / "shm"), JOB, node)
        for e in memory.entries(replica=False) + memory.entries(replica=True):
            if e.complete:
                out.setdefault(node, {}).setdefault(e.owner_rank, {}).setdefault(e.pid.kind, []).append(e.data_size)
    return out


@pytest.mark.timeout(300)
def test_the_plan_matches_the_payloads_a_run_holds(tmp_path, corpus_prefix):
    overrides = _overrides(tmp_path, corpus_prefix)
    # Killed after step 23, mid-batch: node memory then holds what a running job holds, the open batch's step
    # units among them (a clean exit closes the batch, and they are gone).
    env = {i: {"OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "MEGATIER_CRASH_AT": "train.step_end:23"}
           for i in range(2)}
    cluster = LocalCluster(2, 1, trainer_command(overrides), node_env=env)
    cluster.start()
    assert cluster.wait(fail_grace_s=5.0, timeout_s=240) != 0
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f][-1] == 23
    sp = plan(compose_config(overrides), Cluster(2, 1))
    held = _held(tmp_path)
    assert sorted(held) == ["node0", "node1"]
    for node, owners in held.items():
        assert sorted(owners) == [0, 1]  # its own rank and the replica of the other's (the ring)
        for rank, units in owners.items():
            planned = sp.ranks[rank]
            assert units[BASE] and all(abs(size - planned.base) <= 16 for size in units[BASE]), (units[BASE], planned)
            for kind, want in ((DIFF, planned.diff_batch), (STEP, planned.step_unit)):
                sizes = units[kind]
                assert all(abs(size / want - 1) <= 0.20 for size in sizes), (node, rank, kind, sizes, want)
                assert abs(statistics.fmean(sizes) / want - 1) <= 0.10, (node, rank, kind, sizes, want)
        # What a node holds stays within what the plan says node memory may hold.
        held_bytes = sum(s for units in owners.values() for sizes in units.values() for s in sizes)
        assert held_bytes <= sp.node_bytes(int(node[4:]), "node_bound")
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        tier1 = [r["tier1_bytes"] for r in map(json.loads, f) if r.get("tier1_bytes") is not None]
    assert tier1 and max(tier1) <= sp.node_bytes(0, "node_bound")  # node0's memory over the whole run
    remote = [p for p in (tmp_path / "remote" / JOB / "base").rglob("*.safetensors")]
    assert remote and all(abs(os.path.getsize(p) - sp.ranks[int(p.name[4:9])].base) <= 16 for p in remote)
