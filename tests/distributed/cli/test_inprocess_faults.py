"""In-process recovery under the failures a drill at a step's end never stages: a second failure during the
recovery (its consensus, its replay, the first step after it), a failure while the job closes, and a machine
lost with its agent, ranks and spare at once. Each job runs through ``megatier-launch --recovery inprocess``,
as a user would, and must end bit-identical to the fault-free run (lossless diffs), exit 0 and print no
traceback. TORCH_DISTRIBUTED_DEBUG=DETAIL makes any collective two ranks issue differently fail loudly."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.distributed.cli.test_drill import DRILL

pytestmark = pytest.mark.timeout(300)


def launch(work: Path, crash_at: str, *, spares: int = 1, spare_nodes: int = 1) -> dict:
    """One in-process launch of the DRILL job with ``crash_at`` armed; its status, output and final summary."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", MEGATIER_CRASH_AT=crash_at,
               TORCH_DISTRIBUTED_DEBUG="DETAIL")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MEGATIER_NODE_NAME"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "megatier.cli.launch", "--nodes", "2", "--procs-per-node", "2", "--recovery",
           "inprocess", "--spares-per-node", str(spares), "--spare-nodes", str(spare_nodes), "--",
           str(REPO / "pretrain_gpt.py"), *DRILL, "checkpoint=tiered", "checkpoint.base_interval=10",
           f"checkpoint.local.root={work}/shm", f"checkpoint.remote.url={work}/remote", f"logging.run_dir={work}/run"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=280)
    records = [json.loads(line) for name in sorted(os.listdir(work / "run")) if name.startswith("metrics")
               for line in (work / "run" / name).read_text().splitlines() if line.strip()]
    summary = [r for r in records if r.get("event") == "summary"]
    return {"status": proc.returncode, "output": proc.stdout + proc.stderr,
            "recoveries": [r for r in records if r.get("event") == "recovery"],
            "digest": summary[-1]["state_digest"] if summary else None}


def assert_recovered_exactly(run: dict, reference: str) -> None:
    assert run["status"] == 0, run["output"][-4000:]
    assert "Traceback" not in run["output"] and "EnforceNotMet" not in run["output"], run["output"][-4000:]
    assert run["digest"] == reference, run["output"][-4000:]


@pytest.mark.parametrize("second", [pytest.param("replay.mid_batch:0:2", id="replay"),
                                    pytest.param("recover.consensus:1:3", id="consensus"),
                                    pytest.param("train.step_begin:14:2", id="first-step-after")])
def test_a_second_failure_during_the_recovery_starts_another_round(tmp_path, drill_reference, second):
    # Rank 1 dies after step 12; while the job recovers, another rank dies too: a spare takes each.
    run = launch(tmp_path, f"train.step_end:12:1,{second}")
    assert_recovered_exactly(run, drill_reference)
    assert "in-process recovery could not re-form" not in run["output"]
    # The agent says which process died, and how (whoever holds rank 1 then: under load the first world may form
    # again before step 12, with a spare in rank 1).
    assert re.search(r"megatier-agent node\d: \S+ \(rank 1, pid \d+\) was killed by SIGKILL", run["output"])
    assert run["recoveries"] and all(r["end"] >= 11 for r in run["recoveries"]), run["recoveries"]


@pytest.mark.parametrize("crash", [pytest.param("t3.after_commit_before_watermark:29:0", id="rank0-commit"),
                                   pytest.param("t3.before_marker:29:3", id="rank3-marker")])
def test_a_failure_while_the_job_closes_is_recovered_in_place(tmp_path, drill_reference, crash):
    run = launch(tmp_path, crash)
    assert_recovered_exactly(run, drill_reference)
    assert run["recoveries"] and "done: step 30" in run["output"], run["output"][-3000:]


@pytest.mark.parametrize("crash", [pytest.param("launch.first_world:0:1", id="rank", marks=pytest.mark.slow),
                                   pytest.param("launch.first_world:0:2:node", id="node")])
@pytest.mark.slow
def test_a_rank_lost_before_the_first_world_forms_is_replaced_in_place(tmp_path, drill_reference, crash):
    # Before any step: the others stop waiting for it (its agent's report, or its node's lease), a spare takes
    # its rank, and the job trains from the start as if nothing happened.
    run = launch(tmp_path, crash)
    assert_recovered_exactly(run, drill_reference)
    assert "re-forming the job before its first step" in run["output"], run["output"][-3000:]
    assert "takes rank" in run["output"] and "timed out" not in run["output"], run["output"][-3000:]


def test_a_lost_machine_takes_its_agent_ranks_and_spare_and_the_spare_node_replaces_it(tmp_path, drill_reference):
    run = launch(tmp_path, "train.step_end:19:2:node")
    assert_recovered_exactly(run, drill_reference)
    (rec,) = run["recoveries"]
    assert rec["rank_nodes"] == ["node0", "node0", "node2", "node2"], rec  # never node1's own spare
    assert 19 - rec["end"] <= 2 and rec["rank_tiers"][2:] == [["tier2"], ["tier2"]], rec


def test_a_lost_machine_without_a_spare_elsewhere_shrinks_dp_and_finishes(tmp_path):
    run = launch(tmp_path, "train.step_end:19:2:node", spares=0, spare_nodes=0)
    assert run["status"] == 0 and "Traceback" not in run["output"], run["output"][-4000:]
    (rec,) = run["recoveries"]
    assert rec["resharded"] == "(2,1,2) -> (2,1,1)" and set(rec["rank_nodes"]) == {"node0"}, rec
    assert 19 - rec["end"] <= 2 and "done: step 30" in run["output"], rec
