"""benchmarks/bench_recovery.py: its arithmetic, its tables, a quick replay run and the drill plumbing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from benchmarks import bench_recovery as br
from tests.conftest import REPO

SCRIPT = REPO / "benchmarks" / "bench_recovery.py"


# ---- arithmetic -----------------------------------------------------------------------------------

@pytest.mark.parametrize("at_step, k, lost", [(17, 50, 17), (50, 50, 0), (73, 50, 23), (99, 50, 49), (7, 5, 2)])
def test_baseline_lost_steps_goes_back_to_the_previous_multiple_of_k(at_step, k, lost):
    assert br.baseline_lost_steps(at_step, k) == lost


def test_baseline_time_is_load_plus_lost_steps_times_step_time():
    assert br.baseline_time(2.5, 17, 0.5) == pytest.approx(2.5 + 8.5)
    assert br.baseline_time(1.0, 0, 0.5) == 1.0


def test_speedups_charge_decode_to_fused_against_recompute_only():
    vs_seq, vs_rec = br.speedups(fused_s=2.0, sequential_s=5.0, recompute_s=30.0, decode_s=1.0)
    assert vs_seq == pytest.approx(2.5)
    assert vs_rec == pytest.approx(10.0)


def test_seed_exp7_reference_ratios_are_the_papers():
    vs_seq, vs_rec = br.speedups(br.SEED_EXP7.fused_s, br.SEED_EXP7.sequential_s, br.SEED_EXP7.recompute_s)
    assert round(vs_rec, 1) == 14.4  # "14.4x slower than TierCheck"
    assert round(100 * (1 - 1 / vs_seq), 1) == 36.2  # "36.2% reduction"


def test_max_abs_diff_over_every_tensor():
    import torch

    a = {"master": torch.zeros(4), "exp_avg": torch.zeros(4)}
    b = {"master": torch.zeros(4), "exp_avg": torch.tensor([0.0, -0.25, 0.0, 0.0])}
    assert br.max_abs_diff(a, a) == 0.0
    assert br.max_abs_diff(a, b) == 0.25


def test_batches_align_to_the_base_and_keep_a_short_tail():
    assert br.batches(list(range(12)), 5) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11]]
    assert br.batches([], 5) == []


def test_mean_step_time_reads_every_launch_and_skips_events(tmp_path):
    (tmp_path / "metrics.1.jsonl").write_text(json.dumps({"step": 1, "iter_time_s": 1.0}) + "\n")
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"step": 5, "event": "recovery", "t_replay_s": 9.0}, {"step": 6, "iter_time_s": 3.0},
        {"step": 6, "event": "summary", "state_digest": "x"})) + "\n")
    assert br.mean_step_time(str(tmp_path)) == pytest.approx(2.0)
    assert br.mean_step_time(str(tmp_path / "missing")) is None
    assert br.mean_step_time(None) is None


# ---- tables ---------------------------------------------------------------------------------------

def _replay_row(chain, fused, seq, rec, dec, diff=0.0):
    return {"chain": chain, "fused_s": fused, "sequential_s": seq, "recompute_s": rec, "decode_s": dec,
            "fused_vs_sequential_maxabs": diff, "lossless_vs_recompute_maxabs": 0.0}


def test_replay_table_has_a_line_per_chain_and_the_seed_reference():
    text = br.format_replay_table([_replay_row(10, 0.1, 0.4, 5.0, 0.1), _replay_row(100, 1.0, 2.0, 50.0, 0.25)])
    lines = text.splitlines()
    assert len(lines) == 2 + 2 + 1
    assert lines[2].split()[0] == "10" and "4.00x" in lines[2] and "25.0x" in lines[2]
    assert lines[3].split()[0] == "100" and "2.00x" in lines[3] and "40.0x" in lines[3]
    seed = lines[-1]
    assert seed.split()[0] == "seed" and "16.6" in seed and "26.0" in seed and "239.3" in seed
    assert "1.57x" in seed and "14.4x" in seed


def _class_report(at_step=17, end=15, lost=2, run_dir=None):
    rec = {"event": "recovery", "failure_class": "node", "source_tiers": {"tier1": 2, "tier2": 2, "tier3": 0},
           "version": 0, "end": end, "t_consensus_s": 0.5, "t_rollback_s": 1.0, "t_replay_s": 0.5,
           "bytes_tier1": 10, "bytes_tier2": 20, "bytes_tier3": 0, "last_step": None, "steps_lost": None,
           "steps_lost_drill": lost}
    return {"ok": True, "at_steps": [at_step], "recoveries": [rec], "final_loss": 3.0, "run_dir": run_dir}


def test_class_row_compares_megatier_with_reload_and_recompute(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "iter_time_s": 0.5}) + "\n")
    load = {"load_s": 3.0, "bytes": 1, "step_s_world1": 9.0}
    row = br.class_row("node", _class_report(run_dir=str(tmp_path)), load, k=50)
    assert row["megatier_s"] == pytest.approx(2.0)
    assert row["megatier_with_rerun_s"] == pytest.approx(2.0 + 2 * 0.5)
    assert row["baseline_lost_steps"] == 17
    assert row["baseline_s"] == pytest.approx(3.0 + 17 * 0.5)
    assert row["step_source"] == "drill metrics"
    fallback = br.class_row("node", _class_report(run_dir=None), load, k=50)
    assert fallback["step_s"] == 9.0 and fallback["step_source"].startswith("measured here")


def test_classes_table_quotes_the_seeds_table3(tmp_path):
    load = {"load_s": 3.0, "bytes": 1, "step_s_world1": 0.5}
    rows = [br.class_row(c, _class_report(), load, k=50) for c in ("software", "node", "rack")]
    text = br.format_classes_table(rows, 50)
    lines = text.splitlines()
    assert [ln.split()[0] for ln in lines[2:5]] == ["software", "node", "rack"]
    assert "4.5 / 4.3 / 8.8 s" in lines[2] and "9.6 / 8.8 / 18.4 s" in lines[3] and "18.4 / 5.5 / 23.9 s" in lines[4]
    assert "3.8x" in lines[2]  # (3.0 + 17 x 0.5) / (2.0 + 2 x 0.5): both back at the failure step
    assert "CheckFreq 17.8 + 42.9 = 60.5 s" in text and "Gemini" in text and "DataStates-LLM" in text


# ---- arguments ------------------------------------------------------------------------------------

def test_quick_defaults_and_overrides_after_the_separator():
    args = br.parse_args(["--quick", "--part", "replay", "--", "model=small", "optim.lr=1e-3"])
    assert args.chains == [5, 10] and args.repeats == 1 and args.at_step == 9
    assert args.overrides == ["model=small", "optim.lr=1e-3"]
    ours = br.replay_overrides(args, 12, "/tmp/x")
    assert ours.index("model=tiny") < ours.index("model=small")  # the user's override wins
    assert ours[-2:] == ["parallel.tp=1", "parallel.pp=1"]
    assert br.drill_overrides(args)[-2:] == ["model=small", "optim.lr=1e-3"]
    full = br.parse_args([])
    assert full.chains == [10, 50, 100] and full.part == "all" and full.baseline_k == 50


def test_bad_arguments_are_rejected():
    with pytest.raises(SystemExit):
        br.parse_args(["--classes", "software,meteor"])
    with pytest.raises(SystemExit):
        br.parse_args(["--chains", "0,10"])


def test_help_runs():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--out-json" in out.stdout and "--part" in out.stdout


# ---- the drill plumbing, with a fake drill -----------------------------------------------------------

FAKE_DRILL = textwrap.dedent("""
    import json, os, sys
    argv = sys.argv[1:]
    get = lambda flag: argv[argv.index(flag) + 1]
    if os.environ.get("FAKE_DRILL_RC"):
        print("fake drill: recovery did NOT happen as the class requires")
        sys.exit(int(os.environ["FAKE_DRILL_RC"]))
    work, fail, at = get("--work-dir"), get("--fail"), int(get("--at-step"))
    run_dir = os.path.join(work, "run")
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"step": 1, "iter_time_s": 0.25}) + "\\n")
    rec = {"event": "recovery", "failure_class": fail, "source_tiers": {"tier1": 1, "tier2": 0, "tier3": 0},
           "version": 0, "end": at - 2, "t_consensus_s": 0.1, "t_rollback_s": 0.2, "t_replay_s": 0.3,
           "bytes_tier1": 1, "bytes_tier2": 0, "bytes_tier3": 0, "last_step": at, "steps_lost": 2}
    with open(get("--json"), "w") as f:
        json.dump({"ok": True, "recoveries": [rec], "final_loss": 4.0, "run_dir": run_dir, "at_steps": [at],
                   "overrides": argv[argv.index("--") + 1:]}, f)
""")


@pytest.fixture
def fake_drill(tmp_path) -> str:
    path = tmp_path / "fake_drill.py"
    path.write_text(FAKE_DRILL)
    return str(path)


def test_run_drill_fails_clearly_when_the_drill_exits_non_zero(tmp_path, fake_drill, monkeypatch):
    monkeypatch.setenv("FAKE_DRILL_RC", "1")
    cmd = [sys.executable, fake_drill, "--fail", "node"]
    with pytest.raises(SystemExit) as e:
        br.run_drill(cmd, str(tmp_path / "d.json"), str(tmp_path / "d.log"), 60)
    assert "exited 1" in str(e.value) and "did NOT happen" in str(e.value)


def test_drill_command_carries_the_interface_and_every_override(fake_drill, tmp_path):
    args = br.parse_args(["--drill-script", fake_drill, "--at-step", "12", "--", "optim.lr=1e-3"])
    cmd = br.drill_command(args, "rack", str(tmp_path / "w"), str(tmp_path / "d.json"))
    report = br.run_drill(cmd, str(tmp_path / "d.json"), str(tmp_path / "d.log"), 60)
    assert cmd[cmd.index("--fail") + 1] == "rack" and cmd[cmd.index("--at-step") + 1] == "12"
    assert cmd[cmd.index("--nodes") + 1] == "2" and cmd[cmd.index("--procs-per-node") + 1] == "2"
    assert report["overrides"][-1] == "optim.lr=1e-3"
    assert br.mean_step_time(report["run_dir"]) == 0.25


# ---- smoke runs -------------------------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_quick_replay_run_fused_equals_sequential_and_lossless_equals_recompute(tmp_path, corpus_prefix):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--part", "replay", "--out-json", str(out),
                           "--work-dir", str(tmp_path / "work"), "--", f"data.prefix={corpus_prefix}"],
                          capture_output=True, text=True, timeout=170, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["replay"]["rows"]
    assert [r["chain"] for r in rows] == [5, 10]
    for r in rows:
        assert r["fused_vs_sequential_maxabs"] <= 1e-6
        assert r["lossless_vs_recompute_maxabs"] == 0.0
        assert r["configured_vs_recompute_maxabs"] > 0.0  # adaptive diffs are lossy: the check can tell
        assert r["kernel_calls_fused"] == -(-r["chain"] // 5) and r["kernel_calls_sequential"] == r["chain"]
        assert min(r["fused_s"], r["sequential_s"], r["recompute_s"], r["decode_s"]) > 0
    assert "seed" in proc.stdout and "bit for bit" in proc.stdout


@pytest.mark.timeout(180)
def test_classes_part_with_a_fake_drill(tmp_path, corpus_prefix, fake_drill):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--part", "classes", "--drill-script", fake_drill,
                           "--out-json", str(out), "--work-dir", str(tmp_path / "work"), "--",
                           f"data.prefix={corpus_prefix}"],
                          capture_output=True, text=True, timeout=170, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    classes = json.loads(out.read_text())["classes"]
    assert [r["class"] for r in classes["rows"]] == ["software", "node", "rack"]
    for r in classes["rows"]:
        assert r["megatier_s"] == pytest.approx(0.6)
        assert r["baseline_lost_steps"] == 9 and r["step_s"] == 0.25
        assert r["baseline_s"] == pytest.approx(r["baseline_load_s"] + 9 * 0.25)
    assert classes["full_state_bytes"] > 0


@pytest.mark.timeout(120)
def test_classes_part_stops_with_the_drills_failure(tmp_path, fake_drill):
    env = {**os.environ, "FAKE_DRILL_RC": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--part", "classes", "--drill-script", fake_drill,
                           "--work-dir", str(tmp_path / "work")], capture_output=True, text=True, timeout=110,
                          cwd=REPO, env=env)
    assert proc.returncode != 0
    assert "failure drill exited 1" in proc.stderr and "did NOT happen" in proc.stderr
