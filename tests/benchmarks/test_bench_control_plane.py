"""The control-plane simulation at 1k ranks: the agreed point; rank 0 receives O(world), the others O(own units)."""
from __future__ import annotations

import pytest

from benchmarks.bench_control_plane import World, main, parse_args, run

pytestmark = pytest.mark.timeout(300)


def test_one_node_lost_in_a_world_of_1k_ranks_recovers_to_the_end_of_its_chain(capsys):
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


def test_a_world_the_layout_cannot_hold_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--ranks", "1000"])
    assert "multiple of 128" in capsys.readouterr().err


def test_without_a_lost_node_nobody_fetches_from_elsewhere():
    assert run(World(384, 5, lost=-1))["transfers"] == 0
