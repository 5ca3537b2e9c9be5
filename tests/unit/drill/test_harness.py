"""Whether a launch died where the drill armed it: rank 0's last logged step, and for a rack failure the race
in which a node-mate dies before rank 0 has logged the armed step."""
from __future__ import annotations

from megatier.drill.harness import _died_as_armed
from megatier.drill.spec import DrillSpec

ARMED = "[megatier] MEGATIER_CRASH_AT: rank 1 crashing at train.step_end (step 17)\n"


def _spec(fail: str) -> DrillSpec:
    return DrillSpec(fail=fail, at_steps=(17,), nodes=2, procs_per_node=2)


def test_rank_0_logging_the_armed_step_is_dying_as_armed(tmp_path):
    assert _died_as_armed(_spec("node"), 17, 17, str(tmp_path / "no.log"))


def test_a_rack_failure_may_leave_rank_0_one_step_behind_when_the_armed_crash_fired(tmp_path):
    log = tmp_path / "launch.log"
    log.write_text(ARMED)
    assert _died_as_armed(_spec("rack"), 17, 16, str(log))
    assert not _died_as_armed(_spec("node"), 17, 16, str(log))  # only where rank 0's node-mates are armed
    assert not _died_as_armed(_spec("rack"), 17, 15, str(log))
    log.write_text("Traceback: something else killed it at step 17\n")
    assert not _died_as_armed(_spec("rack"), 17, 16, str(log))


def test_in_process_drills_kill_the_victim_nodes_last_ranks_first_and_say_what_they_cannot_do():
    spec = DrillSpec("software", (12, 22), nodes=2, procs_per_node=2, recovery="inprocess")
    assert [spec.victim_ranks(k) for k in range(2)] == [[3], [2]]
    assert (spec.launch.spares_per_node, spec.launch.spare_nodes) == (2, 0)  # a spare per failure
    node = DrillSpec("node", (19,), nodes=2, procs_per_node=2, recovery="inprocess")
    assert node.victim_ranks(0) == [2, 3] and (node.launch.spares_per_node, node.launch.spare_nodes) == (0, 1)
    assert DrillSpec("rack", (5,), recovery="inprocess").problem().startswith("--recovery inprocess drills")
    assert DrillSpec("hang", (5,)).problem().startswith("--fail hang goes with --recovery inprocess")
    assert "--fail-during-recovery" in DrillSpec("software", (5,), recovery="inprocess",
                                                 fail_in_recovery=True).problem()
    assert DrillSpec("node", (19,), recovery="inprocess", fail_in_recovery=True).problem() is None


def test_an_in_process_drill_without_spares_starts_none_and_takes_software_or_node_failures_on_any_node():
    spec = DrillSpec("software", (19,), nodes=2, procs_per_node=2, victim=0, no_spare=True, recovery="inprocess")
    assert spec.problem() is None and (spec.launch.spares_per_node, spec.launch.spare_nodes) == (0, 0)
    assert DrillSpec("node", (19,), no_spare=True, recovery="inprocess").problem() is None
    assert DrillSpec("hang", (19,), no_spare=True, recovery="inprocess").problem().startswith("--no-spare --recovery")
    assert "up to two" in DrillSpec("software", (9, 19, 25), no_spare=True, recovery="inprocess").problem()
    assert "one --at-step" in DrillSpec("node", (9, 19), no_spare=True, recovery="inprocess").problem()
    two = DrillSpec("software", (9, 19), no_spare=True, recovery="inprocess")
    assert [(two.armed_node(k), two.victim_ranks(k)) for k in range(2)] == [(1, [3]), (0, [0])]
    assert "drop --spares-per-node" in DrillSpec("software", (19,), no_spare=True, recovery="inprocess",
                                                 spares_per_node=1).problem()
    assert "the last node" in DrillSpec("node", (19,), victim=0, no_spare=True).problem()  # a relaunch renames
