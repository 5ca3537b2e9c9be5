"""Node memory filed under another node name: adopted only when it can only be this node's."""
from __future__ import annotations

from megatier.checkpoint.tiers.adoption import AreaView, adopt_orphans, adoptions, look


def test_the_one_orphan_only_one_empty_node_sees_is_adopted():
    assert adoptions([AreaView("host-a", ("node0",), False)]) == ({"host-a": "node0"}, [])


def test_orphans_are_left_when_the_choice_is_not_certain():
    # two orphans on one node; one orphan two nodes see (a shared root); a node whose own area is in use
    assert adoptions([AreaView("a", ("node0", "node1"), False)]) == ({}, ["node0", "node1"])
    assert adoptions([AreaView("a", ("node0",), False), AreaView("b", ("node0",), False)]) == ({}, ["node0"])
    assert adoptions([AreaView("a", ("node0",), True)]) == ({}, ["node0"])
    # separate machines, each with its own orphan: each adopts its own
    assert adoptions([AreaView("a", ("node0",), False), AreaView("b", ("node1",), False)]) == (
        {"a": "node0", "b": "node1"}, [])


def test_look_finds_the_orphans_and_whether_the_own_area_is_used(tmp_path):
    (tmp_path / "job" / "node0" / "own").mkdir(parents=True)
    (tmp_path / "job" / "me").mkdir()
    view = look(str(tmp_path), "job", "me", ["me"])
    assert view == AreaView("me", ("node0",), False)
    (tmp_path / "job" / "me" / "own").mkdir()
    assert look(str(tmp_path), "job", "me", ["me"]).own_used
    assert look(str(tmp_path), "other-job", "me", ["me"]) == AreaView("me", (), False)


class _OneRank:
    """A one-rank CheckpointComm: a gather returns this rank's object."""

    rank = 0

    def gather(self, obj, what):
        return [obj]


def test_orphans_left_are_reported_except_in_a_world_an_in_process_recovery_re_formed(tmp_path, caplog):
    (tmp_path / "job" / "node0" / "own").mkdir(parents=True)
    (tmp_path / "job" / "node1" / "own").mkdir(parents=True)
    (tmp_path / "job" / "node2" / "own").mkdir(parents=True)
    for announce in (False, True):  # two orphans: neither is adopted
        caplog.clear()
        left = adopt_orphans(_OneRank(), str(tmp_path), "job", "node2", ["node2"], server=True, announce=announce)
        assert left == ["node0", "node1"]
        said = [r.getMessage() for r in caplog.records if "left in place" in r.getMessage()]
        assert len(said) == int(announce), said  # re-formed: node0 and node1 are this launch's, their ranks moved
