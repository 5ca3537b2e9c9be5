"""The drill report's stall summary: median, p99 and max of the loop's checkpoint wait, against a step."""
import pytest

from megatier.drill.report import _stall_line, stall_summary


def test_stall_summary_reads_every_step_and_ignores_other_records():
    records = [{"step": s, "ckpt_stall_ms": 2.0, "iter_time_s": 0.5} for s in range(1, 199)]
    records += [{"step": 199, "ckpt_stall_ms": 40.0, "iter_time_s": 0.5},
                {"step": 200, "ckpt_stall_ms": 100.0, "iter_time_s": 0.5},
                {"step": 200, "event": "summary", "state_digest": "x"}, {"event": "recovery", "end": 10}]
    s = stall_summary(records)
    assert s["steps"] == 200 and s["median_ms"] == 2.0 and s["max_ms"] == 100.0
    assert s["p99_ms"] == pytest.approx(2.0 + 0.01 * 38.0)  # at rank 0.99 * (200 - 1): just past the 198th value
    assert s["step_median_ms"] == 500.0
    (line,) = _stall_line(s)
    assert "median 2.0, p99 2.4, max 100.0 over 200 steps" in line and "20.0% of a step" in line


def test_stall_summary_needs_steps_to_summarise():
    assert stall_summary([{"event": "summary"}]) is None and _stall_line(None) == []


def test_the_goodput_line_gives_every_part_of_the_summary():
    from megatier.drill.report import _goodput_line, goodput_fields

    parts = {"productive": 6.0, "ckpt_stall": 0.2, "restore": 0.3, "lost": 0.04, "restart": 3.4, "eval": 0.05,
             "other": 0.01}
    summary = {"step": 30, "event": "summary", "state_digest": "x", "goodput": 0.6, "goodput_wall_s": 10.0,
               "goodput_steps_lost": 1, "goodput_restarts": 1, **{f"goodput_{p}_s": s for p, s in parts.items()}}
    assert goodput_fields(summary)["goodput_lost_s"] == 0.04 and "state_digest" not in goodput_fields(summary)
    (line,) = _goodput_line(summary)
    assert line.startswith("  goodput: 60.0% of 10.00 s held over every launch: productive 6.00 s, ckpt_stall ")
    assert "lost 0.040 s (1 step), restart 3.40 s" in line
    assert _goodput_line({"step": 3, "event": "summary"}) == [] and goodput_fields({}) is None
