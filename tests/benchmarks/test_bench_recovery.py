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

@pytest.mark.parametrize("points, interval, offsets", [(2, 10, [1, 9]), (3, 20, [1, 10, 19]),
                                                      (5, 20, [1, 6, 10, 15, 19]), (9, 10, list(range(1, 10)))])
def test_failure_points_span_one_base_interval_from_best_to_worst(points, interval, offsets):
    assert br.point_offsets(points, interval) == offsets
    assert br.point_fractions(points)[0] == 0.0 and br.point_fractions(points)[-1] == 1.0
    assert br.failure_step(1, interval) == interval + 1  # the second interval: a base before it, as in a long run


@pytest.mark.parametrize("points", [2, 3, 7])
def test_baseline_rerun_averages_half_a_k_interval_over_uniform_points(points):
    rerun = [br.baseline_rerun_steps(f, 50) for f in br.point_fractions(points)]
    assert rerun[0] == 0 and rerun[-1] == 49
    assert sum(rerun) / points == pytest.approx(49 / 2)


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


def test_mean_step_time_pools_every_launch_of_every_drill_and_skips_events(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "metrics.1.jsonl").write_text(json.dumps({"step": 1, "iter_time_s": 1.0}) + "\n")
    (a / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"step": 5, "event": "recovery", "t_replay_s": 9.0}, {"step": 6, "iter_time_s": 3.0},
        {"step": 6, "event": "summary", "state_digest": "x"})) + "\n")
    (b / "metrics.jsonl").write_text(json.dumps({"step": 1, "iter_time_s": 5.0}) + "\n")
    assert br.mean_step_time([str(a)]) == pytest.approx(2.0)
    assert br.mean_step_time([str(a), str(b), None]) == pytest.approx(3.0)
    assert br.mean_step_time([str(tmp_path / "missing"), None]) is None


# ---- watching a drill -------------------------------------------------------------------------------

def test_tail_follows_a_rename_and_recreate_and_keeps_the_renamed_files_last_lines(tmp_path):
    path = tmp_path / "metrics.jsonl"
    t = br.Tail(str(path))
    t.poll(1.0)
    assert t.opened == [] and t.lines == []
    path.write_text('{"step": 1}\n{"step": 2')  # a line still being written is not taken
    t.poll(2.0)
    with open(path, "a") as f:
        f.write('}\n{"step": 3}\n')
    os.replace(path, tmp_path / "metrics.1.jsonl")  # the logger of the next launch keeps the old file
    path.write_text('{"event": "recovery"}\n')
    t.poll(3.0)
    t.close()
    assert t.opened == [2.0, 3.0]
    assert t.lines == [(2.0, 0, '{"step": 1}'), (3.0, 0, '{"step": 2}'), (3.0, 0, '{"step": 3}'),
                       (3.0, 1, '{"event": "recovery"}')]


def _tails(tmp_path, metrics_lines, log_lines, opened):
    metrics, log = br.Tail(str(tmp_path / "m")), br.Tail(str(tmp_path / "l"))
    metrics.lines = [(t, k, json.dumps(r)) for t, k, r in metrics_lines]
    metrics.opened = opened
    log.lines = [(t, 0, line) for t, line in log_lines]
    return metrics, log


def test_timeline_and_phases_from_what_the_watch_saw(tmp_path):
    metrics, log = _tails(tmp_path, [(10.0, 0, {"step": 7, "loss": 1.0}), (11.0, 0, {"step": 8, "loss": 1.0}),
                                     (30.0, 1, {"step": 6, "event": "recovery"}), (31.5, 1, {"step": 7, "loss": 1.0}),
                                     (40.0, 1, {"step": 9, "event": "summary", "loss": 1.0})],
                          [(16.0, "failure_drill: launch1-finish on 2 x 2 processes (log x)")], [1.0, 28.0])
    times = br.timeline(metrics, log, at_step=8)
    assert times == {"kill": 11.0, "relaunch": 16.0, "built": 28.0, "recovered": 30.0, "first": 31.5}
    assert br.phases(times, restore_s=0.5) == pytest.approx(
        {"stop_s": 5.0, "build_s": 12.0, "ckpt_init_s": 1.5, "restore_s": 0.5, "first_step_s": 1.5})
    no_relaunch = _tails(tmp_path, metrics_lines=[(t, k, json.loads(line)) for t, k, line in metrics.lines],
                         log_lines=[], opened=[1.0, 28.0])
    assert br.timeline(*no_relaunch, at_step=8) is None


# ---- figures ----------------------------------------------------------------------------------------

TIMES = {"kill": 0.0, "relaunch": 5.0, "built": 25.0, "recovered": 27.0, "first": 28.0}


def test_point_row_restore_rerun_and_end_to_end_against_the_baseline():
    report = _class_report(at_step=17, end=15, lost=2)
    row = br.point_row("node", 1, 0.5, report, TIMES, step_s=0.5, load_s=3.0, k=51)
    assert row["restore_s"] == pytest.approx(2.0)
    assert row["restore_rerun_s"] == pytest.approx(2.0 + 2 * 0.5)
    assert row["baseline_lost_steps"] == 25
    assert row["baseline_restore_rerun_s"] == pytest.approx(3.0 + 25 * 0.5)
    assert (row["stop_s"], row["build_s"], row["ckpt_init_s"], row["first_step_s"]) == pytest.approx((5, 20, 0, 1))
    assert row["e2e_s"] == pytest.approx(28.0 + 2 * 0.5)  # kill -> first step, then the lost steps again
    assert row["baseline_e2e_s"] == pytest.approx(5 + 20 + 1 + 3.0 + 25 * 0.5)
    blind = br.point_row("node", 1, 0.5, report, None, step_s=0.5, load_s=3.0, k=51)
    assert blind["e2e_s"] is None and blind["baseline_e2e_s"] is None and blind["restore_rerun_s"] == 3.0


def test_class_summary_means_over_points_checks_the_target_and_names_what_dominates():
    rows = [br.point_row("rack", o, f, _class_report(at_step=20 + o, end=20 + o - lost, lost=lost), TIMES, 0.5, 3.0,
                         k=51) for o, f, lost in ((1, 0.0, 1), (19, 1.0, 3))]
    s = br.class_summary("rack", rows)
    assert s["restore_rerun_s"] == pytest.approx(2.0 + 2 * 0.5)
    assert s["best_worst_mean_s"] == pytest.approx(3.0)
    assert s["baseline_restore_rerun_s"] == pytest.approx(3.0 + 25 * 0.5)
    assert s["speedup"] == pytest.approx(15.5 / 3.0) and s["target"] == 4.0 and s["target_met"]
    assert s["e2e_parts"]["build_s"] == pytest.approx(20.0)
    assert s["dominant"].startswith("start+build 20.00 s (")
    assert s["e2e_speedup"] == pytest.approx(s["baseline_e2e_s"] / s["e2e_s"])
    assert not br.class_summary("software", rows)["target_met"]  # 5.2x < 10x


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


def test_classes_tables_check_targets_and_quote_the_seeds_table3():
    rows = [br.point_row(c, 1, f, _class_report(), TIMES if c != "rack" else None, 0.5, 3.0, k=51)
            for c in ("software", "node", "rack") for f in (0.0, 1.0)]
    summaries = [br.class_summary(c, [r for r in rows if r["class"] == c]) for c in ("software", "node", "rack")]
    lines = br.format_summary_table(summaries).splitlines()
    assert [ln.split()[0] for ln in lines[2:5]] == ["software", "node", "rack"]
    assert "4.5 / 4.3 / 8.8 s" in lines[2] and "9.6 / 8.8 / 18.4 s" in lines[3] and "18.4 / 5.5 / 23.9 s" in lines[4]
    assert "5.2x" in lines[2]  # (3.0 + 25 x 0.5) / (2.0 + 2 x 0.5)
    assert "10x MISSED" in lines[2] and "8x MISSED" in lines[3] and "4x    met" in lines[4]
    assert "CheckFreq 17.8 + 42.9 = 60.5 s" in lines[-1] and "Gemini" in lines[-1]
    points = br.format_points_table(rows).splitlines()
    assert len(points) == 2 + 6 and points[-1].split()[0] == "rack" and " - " in points[-1]
    phases = br.format_phases_table(summaries).splitlines()
    assert "start+build" in phases[2] and "no timeline" in phases[4]


# ---- arguments ------------------------------------------------------------------------------------

def test_quick_defaults_and_overrides_after_the_separator():
    args = br.parse_args(["--quick", "--part", "replay", "--", "model=small", "optim.lr=1e-3"])
    assert args.chains == [5, 10] and args.repeats == 1 and args.points == 2 and args.base_interval == 10
    assert args.overrides == ["model=small", "optim.lr=1e-3"]
    ours = br.replay_overrides(args, 12, "/tmp/x")
    assert ours.index("model=tiny") < ours.index("model=small")  # the user's override wins
    assert ours[-2:] == ["parallel.tp=1", "parallel.pp=1"]
    drill = br.drill_overrides(args, 12)
    assert drill[-2:] == ["model=small", "optim.lr=1e-3"]
    assert "train.iters=12" in drill and "checkpoint.base_interval=10" in drill
    assert not any(o.startswith("train.iters=") for o in br.drill_overrides(args, None))
    full = br.parse_args([])
    assert full.chains == [10, 50, 100] and full.part == "all" and full.baseline_k == 50
    assert full.points == 5 and full.base_interval == 20


def test_bad_arguments_are_rejected():
    with pytest.raises(SystemExit):
        br.parse_args(["--classes", "software,meteor"])
    with pytest.raises(SystemExit):
        br.parse_args(["--chains", "0,10"])
    with pytest.raises(SystemExit):
        br.parse_args(["--points", "1"])
    with pytest.raises(SystemExit):
        br.parse_args(["--base-interval", "10", "--points", "10"])
    with pytest.raises(SystemExit):
        br.parse_args(["--", "checkpoint.base_interval=30"])


def test_help_runs():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--out-json" in out.stdout and "--part" in out.stdout


# ---- the drill plumbing, with a fake drill -----------------------------------------------------------

# Like the real drill: the job's metrics in <work-dir>/drill/run, kept as metrics.1.jsonl by the relaunch, whose
# announcement goes to stderr; each phase of the recovery takes PHASE_S seconds, restore 0.6 s (the record's).
PHASE_S = 0.4
FAKE_DRILL = textwrap.dedent(f"""
    import json, os, sys, time
    argv = sys.argv[1:]
    get = lambda flag: argv[argv.index(flag) + 1]
    if os.environ.get("FAKE_DRILL_RC"):
        print("fake drill: recovery did NOT happen as the class requires")
        sys.exit(int(os.environ["FAKE_DRILL_RC"]))
    work, fail, at = get("--work-dir"), get("--fail"), int(get("--at-step"))
    run_dir = os.path.join(work, "drill", "run")
    os.makedirs(run_dir)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    def log(record):
        with open(metrics, "a") as f:
            f.write(json.dumps(record) + "\\n")
    for step in range(1, at + 1):
        log({{"step": step, "loss": 5.0, "iter_time_s": 0.25}})
    time.sleep({PHASE_S})
    print("failure_drill: launch1-finish on 2 x 2 processes (log x)", file=sys.stderr, flush=True)
    time.sleep({PHASE_S})
    os.replace(metrics, os.path.join(run_dir, "metrics.1.jsonl"))
    open(metrics, "a").close()
    time.sleep({PHASE_S} + 0.6)
    rec = {{"event": "recovery", "failure_class": fail, "source_tiers": {{"tier1": 1, "tier2": 0, "tier3": 0}},
           "version": 0, "end": at - 2, "t_consensus_s": 0.1, "t_rollback_s": 0.2, "t_replay_s": 0.3,
           "bytes_tier1": 1, "bytes_tier2": 0, "bytes_tier3": 0, "last_step": at, "steps_lost": 2}}
    log(dict(rec, step=at - 2))
    time.sleep({PHASE_S})
    log({{"step": at - 1, "loss": 5.0, "iter_time_s": 0.25}})
    with open(get("--json"), "w") as f:
        json.dump({{"ok": True, "recoveries": [rec], "final_loss": 4.0, "run_dir": run_dir, "at_steps": [at],
                   "overrides": argv[argv.index("--") + 1:]}}, f)
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


def test_a_point_runs_one_drill_in_the_second_interval_and_times_its_recovery(fake_drill, tmp_path):
    args = br.parse_args(["--drill-script", fake_drill, "--base-interval", "20", "--", "optim.lr=1e-3"])
    cmd = br.drill_command(args, "rack", 32, str(tmp_path / "w"), str(tmp_path / "d.json"))
    assert cmd[cmd.index("--fail") + 1] == "rack" and cmd[cmd.index("--at-step") + 1] == "32"
    assert cmd[cmd.index("--nodes") + 1] == "2" and cmd[cmd.index("--procs-per-node") + 1] == "2"
    assert "train.iters=33" in cmd and cmd[-1] == "optim.lr=1e-3"
    report, times = br.run_point(args, str(tmp_path), "rack", 12)
    assert report["at_steps"] == [32] and report["overrides"][-1] == "optim.lr=1e-3"
    assert br.mean_step_time([report["run_dir"]]) == 0.25
    ph = br.phases(times, restore_s=0.6)
    for key in ("stop_s", "build_s", "ckpt_init_s", "first_step_s"):  # each PHASE_S, give or take the polling
        assert PHASE_S / 2 < ph[key] < PHASE_S + 1.0, (key, ph)


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
    assert [(r["class"], r["offset"], r["at_step"]) for r in classes["points"]] == [
        (c, o, 10 + o) for c in ("software", "node", "rack") for o in (1, 9)]
    for r in classes["points"]:
        assert r["restore_s"] == pytest.approx(0.6) and r["steps_lost"] == 2
        assert r["restore_rerun_s"] == pytest.approx(0.6 + 2 * 0.25)
        assert r["e2e_s"] > 4 * PHASE_S
    for s in classes["classes"]:
        assert s["baseline_restore_rerun_s"] == pytest.approx(classes["baseline_load_s"] + 24.5 * 0.25)  # (K-1)/2, K=50
        assert s["e2e_s"] is not None and s["baseline_e2e_s"] is not None
    assert classes["step_s"] == 0.25 and classes["full_state_bytes"] > 0
    assert "dominated by" in proc.stdout and "MISSED" in proc.stdout  # 1.7 s vs 1.1 s: 10x is out of reach


@pytest.mark.timeout(120)
def test_classes_part_stops_with_the_drills_failure(tmp_path, fake_drill):
    env = {**os.environ, "FAKE_DRILL_RC": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--part", "classes", "--drill-script", fake_drill,
                           "--work-dir", str(tmp_path / "work")], capture_output=True, text=True, timeout=110,
                          cwd=REPO, env=env)
    assert proc.returncode != 0
    assert "failure drill exited 1" in proc.stderr and "did NOT happen" in proc.stderr
