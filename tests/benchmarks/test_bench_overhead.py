"""benchmarks/bench_overhead.py: run specs, the alternating schedule, paired and fastest-run estimates, the verdict."""
from __future__ import annotations

import pytest

from benchmarks import bench_overhead as bo


def test_rows_with_an_interval_get_one_spec_per_k():
    specs = bo.expand_rows(["none", "megatier", "sync_torch_save", "in_memory_every_step"], [1, 25])
    assert specs == ["none", "megatier", "sync_torch_save@1", "sync_torch_save@25", "in_memory_every_step"]
    assert bo.split_spec("sync_torch_save@25") == ("sync_torch_save", 25)
    assert bo.split_spec("megatier") == ("megatier", None)


def test_parse_args_rejects_bad_intervals_and_rows():
    assert bo.parse_args(["--k", "25,1,25"]).ks == [1, 25]
    for argv in (["--k", "0"], ["--k", "x"], ["--rows", "none,bogus"]):
        with pytest.raises(SystemExit):
            bo.parse_args(argv)


def test_every_other_run_is_none_and_the_order_reverses():
    seq = bo.schedule(["none", "a", "b"], 2)
    assert seq == [("none", 0), ("a", 0), ("none", 0), ("b", 0), ("none", 0),
                   ("b", 1), ("none", 1), ("a", 1), ("none", 1)]


def _run(row, mean_s, seq):
    run = {"row": row, "mean_step_s": mean_s, "mean_stall_ms": 0.5, "max_stall_ms": 2.0,
           "shard_state_bytes": 1000, "seq": seq}
    if row == "megatier":
        run.update(diff="adaptive", tiers=["local"], diff_bytes_per_step=15.0, base_bytes_per_base=1000.0)
    return run


def test_summary_pairs_each_run_with_its_neighbours_and_compares_fastest_runs():
    # none drifts from 1.0 to 1.2; each row costs +2% (megatier) or +10% (baseline) of its neighbours.
    runs = [_run("none", 1.0, 0), _run("megatier", 1.02 * 1.05, 1), _run("none", 1.1, 2),
            _run("sync_torch_save@1", 1.10 * 1.15, 3), _run("none", 1.2, 4)]
    s = bo.summarize(runs, ["none", "megatier", "sync_torch_save@1"])
    assert s["megatier"]["overhead_pct"] == pytest.approx(2.0)
    assert s["sync_torch_save@1"]["overhead_pct"] == pytest.approx(10.0)
    assert s["megatier"]["fastest_pct"] == pytest.approx(2.0)  # its only reference is (1.0 + 1.1) / 2
    assert s["none"]["overhead_pct"] == 0.0
    assert s["megatier"]["diff_fraction_of_shard_state"] == pytest.approx(0.015)


def test_verdict_states_target_and_lowest_per_interval_group():
    summary = {
        "none": {"overhead_pct": 0.0, "fastest_pct": 0.0},
        "megatier": {"overhead_pct": 2.0, "fastest_pct": 3.0},
        "sync_torch_save@1": {"overhead_pct": 40.0, "fastest_pct": 38.0},
        "sync_torch_save@25": {"overhead_pct": 1.0, "fastest_pct": 4.0},
    }
    lines = bo.verdict(summary)
    assert lines[0].startswith("target (paired median): megatier +2.0% <= 3.5% -> MET")
    assert lines[1].startswith("target (of fastest): megatier +3.0% <= 3.5% -> MET")
    assert lines[2].startswith("lowest against the rows checkpointing every step: yes")
    # Lower on one estimate only is not "lowest".
    assert lines[3].startswith("lowest against the rows checkpointing K=25: no")
    summary["megatier"]["fastest_pct"] = 3.6
    assert "-> MISSED" in bo.verdict(summary)[1]
