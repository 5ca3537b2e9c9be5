"""In-process recovery drills: the survivors keep their processes and state, hot spares take the lost ranks, and
the job ends bit-identical to the same job without a failure (lossless diffs), all in one launch; a second
failure during a recovery starts another round, still bit-identical."""
from __future__ import annotations

import pytest

from tests.distributed.cli.test_drill import drill

pytestmark = pytest.mark.timeout(420)


def _timeline_adds_up(timeline: dict, mode: str = "inprocess") -> None:
    split = [timeline[f"recovery_{p}_s"] for p in ("detection", "reform", "restore", "rerun")]
    assert timeline["recovery_mode"] == mode
    assert all(t >= 0 for t in split) and sum(split) == pytest.approx(timeline["recovery_total_s"], abs=1e-6)


@pytest.mark.slow
def test_two_software_failures_are_recovered_in_place_by_spares(tmp_path, drill_reference):
    report = drill(tmp_path, "--recovery", "inprocess", "--fail", "software", "--at-step", "12", "22")
    assert report["ok"] and report["returncode"] == 0, report["stdout"]
    first, second = report["recoveries"]
    # Rank 3 died after step 12: the survivors kept step 12 in memory and read nothing; its spare read Tier-1.
    assert first["end"] == 12 and first["ranks_in_place"] == [0, 1, 2], first
    assert first["rank_tiers"] == [[], [], [], ["tier1"]] and first["bytes_tier2"] == first["bytes_tier3"] == 0
    # Then rank 2 died after step 22 (a spare again): at most one step lost, nothing from Tier-2 or Tier-3.
    assert 22 - second["end"] <= 1 and second["rank_tiers"][2] == ["tier1"], second
    assert second["bytes_tier2"] == second["bytes_tier3"] == 0
    for timeline in report["recovery_timelines"]:
        _timeline_adds_up(timeline)
    assert "(inprocess)" in report["stdout"] and "in place" in report["stdout"]
    assert report["final_digest"] == drill_reference


@pytest.mark.slow
def test_a_node_of_spares_replaces_a_lost_node_from_tier2(tmp_path, drill_reference):
    report = drill(tmp_path, "--recovery", "inprocess", "--fail", "node", "--at-step", "19")
    assert report["ok"] and report["returncode"] == 0, report["stdout"]
    (rec,) = report["recoveries"]
    # The spare node (node2) holds the lost node's ranks; their state came from the ring peer's memory.
    assert rec["rank_nodes"] == ["node0", "node0", "node2", "node2"], rec
    assert rec["rank_tiers"][2:] == [["tier2"], ["tier2"]] and rec["bytes_tier3"] == 0
    assert all(t in ([], ["tier1"]) for t in rec["rank_tiers"][:2]), rec  # in place, or rolled back from Tier-1
    assert 19 - rec["end"] <= 2
    _timeline_adds_up(report["recovery_timelines"][0])
    assert report["final_digest"] == drill_reference


def test_a_hung_rank_is_killed_by_its_agent_and_replaced(tmp_path, drill_reference):
    # Rank 3 is stopped (SIGSTOP) after step 19. Its agent's watchdog kills it after 10 s stopped, well
    # before the collective's 30 s timeout; its peers' collectives then fail on the closed connections and the
    # round, told of its death, does not wait for it.
    report = drill(tmp_path, "--recovery", "inprocess", "--fail", "hang", "--at-step", "19")
    assert report["ok"] and report["returncode"] == 0, report["stdout"]
    (rec,) = report["recoveries"]
    assert rec["end"] == 19 and rec["ranks_in_place"] == [0, 1, 2] and rec["rank_tiers"][3] == ["tier1"], rec
    (timeline,) = report["recovery_timelines"]
    _timeline_adds_up(timeline)
    assert 9 < timeline["recovery_detection_s"] < 25 and timeline["recovery_reform_s"] < 20, timeline
    assert report["final_digest"] == drill_reference


@pytest.mark.slow
def test_a_failure_during_the_recovery_starts_another_round(tmp_path, drill_reference):
    # node1 is lost with its agent and spare; while the survivors recover, rank 0 dies in its rollback: a second
    # round gives rank 0 to node0's spare, which reads its units from node0's memory, in the same launch.
    report = drill(tmp_path, "--recovery", "inprocess", "--fail", "node", "--fail-during-recovery", "--at-step",
                   "19")
    assert report["ok"] and report["returncode"] == 0, report["stdout"]
    (rec,) = report["recoveries"]
    assert rec["rank_nodes"] == ["node0", "node0", "node2", "node2"], rec
    assert rec["rank_tiers"][0] == ["tier1"] and rec["rank_tiers"][2:] == [["tier2"], ["tier2"]], rec
    _timeline_adds_up(report["recovery_timelines"][0])
    assert not any("fell back to a relaunch" in n for n in report["notes"]), report["notes"]
    assert report["final_digest"] == drill_reference


@pytest.mark.slow
def test_without_a_spare_dp_shrinks_in_place_and_a_dropped_survivor_takes_the_next_lost_rank(tmp_path):
    # Rank 1 dies on node0 and nobody replaces it: replica 0 (node0) is dropped, its survivor (rank 0, the
    # metrics writer) waits as a spare, and node1's ranks go on as ranks 0 and 1 of dp=1. Then that rank 0 dies
    # and the waiting survivor takes its place, reading its units from node1's memory.
    report = drill(tmp_path, "--recovery", "inprocess", "--fail", "software", "--no-spare", "--victim", "0",
                   "--at-step", "19", "25", "--compare")
    assert report["ok"] and report["returncode"] == 0, report["stdout"]
    shrink, spare = report["recoveries"]
    assert shrink["resharded"] == "(2,1,2) -> (2,1,1)" and shrink["bytes_tier3"] == 0, shrink
    assert shrink["canonical_digest"] == report["reference_canonical_digest"]  # the state at E, bit for bit
    assert 19 - shrink["end"] <= 2  # node0's newest steps come from their ring replicas, as after a node loss
    assert not spare["resharded"] and spare["rank_nodes"] == ["node0", "node1"], spare
    assert 25 - spare["end"] <= 1 and spare["ranks_in_place"] in ([1], []) and spare["bytes_tier3"] == 0, spare
    for timeline in report["recovery_timelines"]:
        _timeline_adds_up(timeline)
    assert report["final_loss"] is not None  # rank 0's metrics followed it to the end of the job
