"""The control-plane simulation at 1k ranks: the agreed point; rank 0 receives O(world), the others O(own units);
the decision from node summaries grows as the nodes."""
from __future__ import annotations

import pytest

from benchmarks.bench_control_plane import World, main, parse_args, run

pytestmark = pytest.mark.timeout(600)  # 165 s on a quiet 2-core box; CI shares its cores


def test_a_node_lost_in_1k_ranks_recovers_and_the_node_summaries_decide_in_o_nodes(capsys):
    rows = main(["--ranks", "512,1024"])
    small, big = rows
    assert (big["version"], big["end"], big["rounds"]) == (50, 100, 1 + 10)  # base 50, ten batches of 5 steps
    # Only the lost node's 8 ranks fetch from elsewhere (the ring successor's memory), one unit a round.
    assert big["transfers"] == 8 * big["rounds"]
    # Rank 0 receives every rank's share of its node's listing: O(world) ...
    assert 1.9 < big["rank0_receives"] / small["rank0_receives"] < 2.1
    # ... every other rank its own plan, whatever the world, and a few bytes of node names per rank.
    assert 0.95 < big["other_holds"] / small["other_holds"] < 1.05
    assert 0.95 < (big["other_receives"] - big["names_bytes"]) / (small["other_receives"] - small["names_bytes"]) < 1.05
    assert big["rank0_holds"] > 500 * big["other_holds"]
    assert big["old_receives"] > 50 * big["other_receives"]
    # The membership round: the spare node takes the lost node's 8 ranks; the decision every member reads, and
    # the decider's one read of the member list, grow as the world; a join does not.
    assert big["round_spares_taken"] == 8
    assert 1.9 < big["round_decision_bytes"] / small["round_decision_bytes"] < 2.1
    assert 1.9 < big["round_member_bytes"] / small["round_member_bytes"] < 2.1
    out = capsys.readouterr().out
    assert "| 1,024 |" in out and "growth x" in out
    # The decision from node summaries (restore's first path), same runs: the decider reads a few holdings per
    # node, receives and holds O(nodes) bytes, sends every leader an O(nodes) point; a leader receives its
    # ranks' copies only; every plan equals the one rank 0 cut from the whole inventory. Items and bytes, not
    # seconds.
    assert small["new_mismatched"] == [] and big["new_mismatched"] == []
    assert (big["new_version"], big["new_end"]) == (big["version"], big["end"]) == (50, 100)
    nodes = big["nodes"] / small["nodes"]
    assert nodes == 2
    for key in ("new_holdings", "new_spans", "new_decider_receives", "new_point_bytes", "new_decider_peak"):
        assert big[key] / small[key] <= 1.05 * nodes, key
    assert big["new_holdings"] <= 2 * big["nodes"] + 1  # Tier-1 and Tier-2 a node; Tier-3's headers: one
    # Tier-3: rank 0 reads the record headers (a line per 256 ranks), a leader the one part of its ranks a unit.
    assert big["t3_header_bytes"] / small["t3_header_bytes"] <= 1.05 * nodes
    assert small["t3_leader_read_bytes"] > 0
    assert 0.95 < big["t3_leader_read_bytes"] / small["t3_leader_read_bytes"] < 1.05
    assert 0.99 < big["new_summary_bytes"] / small["new_summary_bytes"] < 1.01  # node names gain a digit
    assert big["new_leader_receives"] == small["new_leader_receives"]  # the copies of its own 8 ranks' units
    assert big["new_leader_peak"] < 1.1 * small["new_leader_peak"]
    # Against rank 0's whole inventory, O(world) stamps: the decider receives and holds a small fraction of it.
    assert big["new_decider_receives"] * 10 < big["rank0_receives"]
    assert big["new_decider_peak"] * 20 < big["rank0_holds"]


def test_a_world_the_layout_cannot_hold_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--ranks", "1000"])
    assert "multiple of 128" in capsys.readouterr().err


def test_without_a_lost_node_nobody_fetches_from_elsewhere():
    assert run(World(384, 5, lost=-1))["transfers"] == 0
