"""The fault campaign, short forms: eight kinds of fault through one job, and the four reliability faults
through another; each job must end bit-identical to its fault-free run."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO
from tools.chaos.campaign import Campaign
from tools.chaos.catalogue import CATALOGUE
from tools.chaos.s3_proxy import FaultRule

pytestmark = pytest.mark.timeout(420)

SHORT = "crash t1.mid_write,crash replay.mid_batch,node,rack,t1 truncate,t3 flip,s3 resets,stale area"
RELIABILITY = "nan base,grad nan,activation flip,crash after restore"


def _campaign(tmp_path, faults: int, seed: int, types: str) -> str:
    """Run a seeded campaign of ``faults`` faults of ``types``; its report, once it exited 0."""
    cmd = [sys.executable, str(REPO / "tools" / "chaos" / "campaign.py"), "--faults", str(faults), "--seed",
           str(seed), "--types", types, "--work-dir", str(tmp_path / "campaign")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    return proc.stdout


def test_the_catalogue_covers_every_fault_class_the_campaign_promises():
    assert len(CATALOGUE) >= 20
    for needed in ("node", "rack", "hang", "t1 flip", "t2 flip", "t3 flip", "t3 truncate", "s3 slowdown",
                   "s3 500 one rank", "s3 resets", "s3 full", "t1 full", "stale area", "lease",
                   *RELIABILITY.split(",")):
        assert needed in CATALOGUE, needed
    with pytest.raises(ValueError, match="use one of"):
        FaultRule("teapot")


@pytest.mark.slow
def test_a_short_campaign_survives_every_fault_bit_exactly(tmp_path):
    report = _campaign(tmp_path, 8, 5, SHORT)
    assert "8/8 faults recovered as required" in report and "bit-identical" in report
    assert "RESULT: every fault survived or reported" in report


@pytest.mark.slow
def test_the_reliability_faults_are_caught_or_fallen_back_from_and_the_job_ends_bit_identical(tmp_path):
    """A NaN base under a valid checksum (another copy serves), a NaN gradient and a flipped activation bit (the
    step's rerun catches them), a step that crashes whenever it is reached in two launches in a row (the next
    launch falls back to the previous base and trains the steps after it again)."""
    report = _campaign(tmp_path, 4, 3, RELIABILITY)
    assert "4/4 faults recovered as required" in report and "bit-identical" in report
    assert report.count("a transient fault on rank(s)") == 2


@pytest.mark.parametrize("restored_first", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_recurring_crash_must_make_the_guard_fall_back_only_after_a_restored_point(tmp_path, restored_first):
    """A step that crashes in the job's first launch follows no restored point: the launch after it restores the
    newest point, as it should. After a restored point, the restart-loop guard must fall back instead."""
    campaign = Campaign({"faults": 1, "types": ["crash after restore"]}, str(tmp_path))
    (event,) = campaign.events
    event.restored_first, event.recovery = restored_first, {"version": 10, "end": 12, "fallback": None}
    problems = campaign._problems(0, {"step": campaign.iters, "state_digest": "d"}, {"state_digest": "d"})
    assert bool(problems) == restored_first, problems


@pytest.mark.slow
def test_in_process_a_node_fault_kills_the_whole_node_and_each_launch_ends_past_its_fault(tmp_path):
    campaign = Campaign({"faults": 2, "types": ["node", "software"], "recovery": "inprocess"}, str(tmp_path))
    envs = {e.fault.name: campaign._env(e)[e.victim]["MEGATIER_CRASH_AT"] for e in campaign.events}
    assert envs["node"].endswith(":node") and not envs["software"].endswith(":node"), envs
    relaunch = Campaign({"faults": 1, "types": ["node"]}, str(tmp_path))
    assert not relaunch._env(relaunch.events[0])[relaunch.events[0].victim]["MEGATIER_CRASH_AT"].endswith(":node")
