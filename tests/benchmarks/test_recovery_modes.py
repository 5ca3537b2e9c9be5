"""bench_recovery's modes part: drill commands in each mode, the per-point rows, the means, the speedup and the
targets, and the table."""
from __future__ import annotations

import pytest

from benchmarks import recovery_modes as rm


def _report(mode: str, total: float, in_place=(0, 1, 2)) -> dict:
    split = {"detection": total * 0.1, "reform": total * 0.6, "restore": total * 0.2, "rerun": total * 0.1}
    timeline = {"recovery_mode": mode, "recovery_total_s": total, **{f"recovery_{k}_s": v for k, v in split.items()}}
    rec = {"end": 21, "ranks_in_place": list(in_place) if mode == "inprocess" else [], "rank_tiers": []}
    return {"recovery_timelines": [timeline], "recoveries": [rec], "at_steps": [21]}


def test_the_mode_goes_before_the_jobs_overrides():
    cmd = ["python", "-m", "megatier.cli.drill", "--fail", "node", "--", "model=small"]
    assert rm.modes_command(cmd, "inprocess") == ["python", "-m", "megatier.cli.drill", "--fail", "node",
                                                  "--recovery", "inprocess", "--", "model=small"]


def test_the_shrink_class_drills_a_node_failure_without_a_spare_and_has_no_target():
    cmd = ["python", "-m", "megatier.cli.drill", "--fail", rm.drilled_failure("shrink"), "--", "model=small"]
    assert rm.modes_command(cmd, "relaunch", "shrink") == ["python", "-m", "megatier.cli.drill", "--fail", "node",
                                                           "--recovery", "relaunch", "--no-spare", "--",
                                                           "model=small"]
    rows = [rm.mode_point("shrink", m, 1, 0.0, _report(m, t, in_place=()), 0.1, 0.2, 50, 0.0)
            for m, t in (("relaunch", 12.0), ("inprocess", 0.8))]
    s = rm.mode_summary("shrink", rows)
    assert s["met"] is None and s["speedup"] == pytest.approx(15.0)
    table = rm.format_modes_report({"points": 1, "offsets": [1], "base_interval": 20, "baseline_k": 50,
                                    "classes": [s]})
    assert "15.0x faster than relaunch, 0.80 s (no target)" in table


def test_the_summary_means_each_part_and_checks_the_targets():
    rows = []
    for total_r, total_i in ((12.0, 0.5), (14.0, 0.7)):
        rows.append(rm.mode_point("software", "relaunch", 1, 0.0, _report("relaunch", total_r), 0.1, 0.2, 50, 0.0))
        rows.append(rm.mode_point("software", "inprocess", 1, 0.0, _report("inprocess", total_i), 0.1, 0.2, 50, 0.0))
    s = rm.mode_summary("software", rows)
    assert s["points"] == 2 and s["relaunch"]["total_s"] == pytest.approx(13.0)
    assert s["inprocess"]["reform_s"] == pytest.approx(0.36) and s["inprocess"]["max_s"] == 0.7
    assert s["speedup"] == pytest.approx(13.0 / 0.6) and s["met"]
    # The baseline relaunches too (its detection + re-form), reloads (0.2 s) and computes its step again.
    assert s["baseline_e2e_s"] == pytest.approx(0.7 * 13.0 + 0.2 + 0.1)
    slow = [dict(r, total_s=2.0) if r["mode"] == "inprocess" else r for r in rows]
    assert not rm.mode_summary("software", slow)["met"]  # over 1.5 s
    table = rm.format_modes_report({"points": 2, "offsets": [1], "base_interval": 20, "baseline_k": 50,
                                    "classes": [s, rm.mode_summary("software", slow)]})
    assert "21.7x faster than relaunch" in table and "met" in table and "MISSED" in table
