"""Failure drills on simulated clusters: each class recovers exactly, from the tier it should, and every crash
point leaves a state the next launch recovers from without loss, hang or uncommitted data.

A recovery test compares a run with an injected failure to the same run without one: with lossless diffs
(fp32) the final ``state_digest`` of the drilled run must equal the fault-free run's, bit for bit.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatier.checkpoint.commit.reader import RemoteReader
from megatier.checkpoint.tiers.remote import open_remote_store
from megatier.drill.cluster import LocalCluster
from megatier.observe.goodput import PARTS
from tests.conftest import REPO

JOB = "drill"
# 2 nodes x 2 processes, tp=2 x dp=2; base 0 finishes its paced Tier-2 transfer by step ~17 of 20.
DRILL = ["model=tiny", "parallel.tp=2", "train.iters=30", "checkpoint.base_interval=20",
         "checkpoint.diff.compression=fp32", "logging.wandb.mode=disabled", "data.seq_len=64",
         "train.global_batch_size=4", "train.micro_batch_size=2", "parallel.timeout_s=30"]
# The same job as a Llama-family model (grouped-query attention: tp=2 divides its 2 key/value heads).
LLAMA_DRILL = ["model=llama_tiny" if o == "model=tiny" else o for o in DRILL]
# A tiny mixture of experts at ep=2 x dp=2, 2 nodes x 1 process: each node holds half the experts. Base 10 is whole
# on the ring peer by step 17 (Tier-2 pacing leaves a margin of 2 steps before base 20), so a failure at 19 finds it.
MOE_DRILL = ["model=tiny_moe", "parallel.ep=2", "train.iters=20", "checkpoint.base_interval=10",
             "checkpoint.diff.compression=fp32", "logging.wandb.mode=disabled", "data.seq_len=64",
             "train.global_batch_size=4", "train.micro_batch_size=2", "parallel.timeout_s=30"]
# 2 nodes x 1 process for the crash points: every point is reached within 30 steps with bases every 10.
POINTS = ["model=tiny", "train.iters=30", "checkpoint=tiered", "checkpoint.base_interval=10",
          "checkpoint.diff.compression=fp32", "logging.wandb.mode=disabled", "logging.progress=false",
          f"checkpoint.job_id={JOB}", "data.seq_len=64", "train.global_batch_size=4", "train.micro_batch_size=2",
          "parallel.timeout_s=20"]


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")


def drill(tmp_path: Path, *args: str, overrides=DRILL) -> dict:
    out = tmp_path / "drill.json"
    cmd = [sys.executable, str(REPO / "scripts" / "failure_drill.py"), "--work-dir", str(tmp_path / "work"),
           "--json", str(out), *args, "--", *overrides]
    started = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=540)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    report["stdout"], report["returncode"] = proc.stdout, proc.returncode
    report["seconds"] = time.monotonic() - started
    return report


def assert_goodput_adds_up(report: dict) -> None:
    """The summary's goodput parts add up to the wall time the ledger held, which lies between the steps' own
    time and the drill's; the lost work is the steps the drill lost, at the times they took in the launch that
    failed (metrics.1.jsonl); restore is the recovery record's. The recovery's timing (failure to the first step
    after it) adds up too."""
    run = Path(report["run_dir"])
    (rec,) = report["recoveries"]
    launches = [[json.loads(line) for line in (run / name).read_text().splitlines() if line.strip()]
                for name in ("metrics.1.jsonl", "metrics.jsonl")]
    steps = [[r for r in launch if "event" not in r] for launch in launches]
    final = [r for r in launches[1] if r.get("event") == "summary"][-1]
    wall, parts = final["goodput_wall_s"], {p: final[f"goodput_{p}_s"] for p in PARTS}
    assert sum(parts.values()) == pytest.approx(wall, rel=1e-6), final
    assert sum(r["iter_time_s"] for launch in steps for r in launch) < wall < report["seconds"], final
    assert 0 < final["goodput"] < 1 and parts["restart"] > 0, final
    lost = [r["iter_time_s"] for r in steps[0] if r["step"] > rec["end"]]
    assert len(lost) == rec["steps_lost_drill"] == final["goodput_steps_lost"], (rec, final)
    assert parts["lost"] == pytest.approx(sum(lost), rel=1e-6)
    assert parts["restore"] == pytest.approx(rec["t_consensus_s"] + rec["t_rollback_s"] + rec["t_replay_s"])
    assert parts["productive"] == pytest.approx(sum(r["iter_time_s"] for r in steps[0] if r["step"] <= rec["end"])
                                                + sum(r["iter_time_s"] for r in steps[1]), rel=1e-6)
    assert "  goodput: " in report["stdout"]
    # The recovery's own timing, from the failed launch's last step to the relaunch's first: parts that add up.
    (timeline,) = report["recovery_timelines"]
    split = [timeline[f"recovery_{p}_s"] for p in ("detection", "reform", "restore", "rerun")]
    assert all(t >= 0 for t in split) and sum(split) == pytest.approx(timeline["recovery_total_s"], abs=1e-6)
    assert timeline["recovery_detection_s"] > 0 and timeline["recovery_reform_s"] > 1.0  # a relaunch: imports
    assert timeline["recovery_restore_s"] == pytest.approx(parts["restore"])  # the recovery record's
    assert timeline["recovery_steps_rerun"] == rec["steps_lost_drill"]
    assert timeline["recovery_total_s"] < report["seconds"]
    assert "failure to the first step after it" in report["stdout"]


def run_job(work: Path, overrides: list[str], *, nodes: int, procs: int, env: dict | None = None,
            fail_grace_s: float = 5.0) -> tuple[int, float]:
    """One launch of pretrain_gpt.py on a simulated cluster; returns (exit status, seconds)."""
    args = [str(REPO / "pretrain_gpt.py"), *overrides, f"checkpoint.local.root={work}/shm",
            f"checkpoint.remote.url={work}/remote", f"logging.run_dir={work}/run"]
    os.environ.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    cluster = LocalCluster(nodes, procs, args, node_env=env)
    t0 = time.monotonic()
    cluster.start()
    return cluster.wait(fail_grace_s=fail_grace_s, timeout_s=300), time.monotonic() - t0


def records(work: Path) -> list[dict]:
    with open(work / "run" / "metrics.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def summary(work: Path) -> dict:
    return [r for r in records(work) if r.get("event") == "summary"][-1]


def fault_free_digest(tmp_path_factory, name: str, overrides: list[str], *, nodes: int = 2,
                      procs: int = 2) -> str:
    """The final state digest of the job of ``overrides`` run without a failure and without checkpointing (the
    drills' reference: checkpointing must not change training)."""
    work = tmp_path_factory.mktemp(name)
    status, _ = run_job(work, [*overrides, "checkpoint.enabled=false"], nodes=nodes, procs=procs)
    assert status == 0
    return summary(work)["state_digest"]


@pytest.fixture(scope="module")
def llama_reference(tmp_path_factory) -> str:
    return fault_free_digest(tmp_path_factory, "llama_ref", LLAMA_DRILL)


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory) -> str:
    return fault_free_digest(tmp_path_factory, "moe_ref", MOE_DRILL, procs=1)


@pytest.fixture(scope="module")
def points_reference(tmp_path_factory) -> str:
    return fault_free_digest(tmp_path_factory, "points_ref", POINTS, procs=1)


# ---- the three classes, lossless, bit-identical ------------------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["tiny", "llama_tiny"])
def test_stage_failure_is_rebuilt_by_checkfree(tmp_path, model):
    """Stage 2 of 4 dies at step 12 and loses every copy (Tier-1, its replicas, its Tier-3 objects); the relaunch
    rebuilds it from stages 1 and 3 with CheckFree, loses no step, and says the result is not exact."""
    overrides = [f"model={model}", "model.num_layers=4", "parallel.pp=4", "train.iters=16",
                 "checkpoint.base_interval=10", "checkpoint.diff.compression=fp32", "logging.wandb.mode=disabled",
                 "data.seq_len=64", "train.global_batch_size=4", "train.micro_batch_size=1", "parallel.timeout_s=30"]
    report = drill(tmp_path, "--fail", "stage", "--stage", "2", "--at-step", "12", overrides=overrides)
    assert report["ok"], report["stdout"]
    (rec,) = report["recoveries"]
    assert rec["failure_class"] == "stage" and rec["exact"] is False and rec["end"] == 12
    assert rec["steps_lost_drill"] == 0
    assert rec["checkfree"]["rebuilds"][0]["neighbours"] == [1, 3]
    assert rec["rank_tiers"] == [["tier1"], ["tier1"], [], ["tier1"]] and rec["bytes_tier3"] == 0
    assert any("rank00002" in f and "does not exist" in f for f in rec["fallbacks"])  # its Tier-3 copy is gone
    assert "NOT exact" in report["stdout"]
    final = [json.loads(line) for line in Path(report["run_dir"], "metrics.jsonl").read_text().splitlines()]
    assert all(r["inexact_since"] == 12 for r in final if r.get("event") is None and "loss" in r)


@pytest.mark.timeout(600)
def test_software_failure_recovers_from_tier1_only(tmp_path, drill_reference):
    report = drill(tmp_path, "--fail", "software", "--at-step", "19")
    assert report["ok"], report["stdout"]
    (rec,) = report["recoveries"]
    assert rec["failure_class"] == "software" and all(t == ["tier1"] for t in rec["rank_tiers"])
    assert rec["bytes_tier2"] == rec["bytes_tier3"] == 0 < rec["bytes_tier1"]
    assert 19 - rec["end"] <= 5 and rec["steps_lost"] == 19 - rec["end"]
    assert report["final_digest"] == drill_reference
    # The drill's pictures lie next to its metrics (megatier-plot's figures of every launch).
    pictures = {os.path.basename(p): os.path.getsize(p) for p in report["plots"]}
    assert {"loss.png", "step_time.png", "recovery_points.png", "tier_bytes.png"} <= pictures.keys(), pictures
    assert all(size > 10_000 for size in pictures.values())
    assert all(os.path.dirname(p) == report["run_dir"] for p in report["plots"])
    assert_goodput_adds_up(report)


@pytest.mark.timeout(600)
def test_node_failure_serves_the_lost_node_from_tier2(tmp_path, drill_reference):
    # node0 hosts the Tier-3 coordinator (rank 0): losing it is the harder case.
    report = drill(tmp_path, "--fail", "node", "--victim", "0", "--at-step", "19")
    assert report["ok"], report["stdout"]
    (rec,) = report["recoveries"]
    lost = {r for r, node in enumerate(rec["rank_nodes"]) if node == "node0"}
    assert len(lost) == 2 and rec["failure_class"] == "node"
    for r, tiers in enumerate(rec["rank_tiers"]):
        assert tiers == (["tier2"] if r in lost else ["tier1"]), rec
    assert rec["bytes_tier3"] == 0 and 19 - rec["end"] <= 5
    assert report["final_digest"] == drill_reference
    # Step 19's record never reached the ring peer: at least that step is computed again, and counted lost.
    assert rec["steps_lost_drill"] >= 1
    assert_goodput_adds_up(report)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("fail", ["software", "node"])
def test_llama_recovers_bit_identical(tmp_path, llama_reference, fail):
    """model.arch=llama at tp=2 x dp=2: a software and a node failure recover from the tiers their class requires
    and end bit-identical to the fault-free run."""
    report = drill(tmp_path, "--fail", fail, "--at-step", "19", overrides=LLAMA_DRILL)
    assert report["ok"], report["stdout"]
    (rec,) = report["recoveries"]
    assert rec["failure_class"] == fail and rec["bytes_tier3"] == 0
    lost = {r for r, node in enumerate(rec["rank_nodes"]) if node == "node1"}
    assert rec["rank_tiers"] == [["tier2"] if r in lost and fail == "node" else ["tier1"] for r in range(4)]
    assert report["final_digest"] == llama_reference


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fail", ["software", "node"])
def test_an_ep2_moe_job_recovers_bit_identical(tmp_path, moe_reference, fail):
    """model=tiny_moe at ep=2 x dp=2, one rank a node (each holds two of the four experts): a software and a node
    failure restore the expert shards from the tiers their class requires, replay base 10's expert diffs, and end
    bit-identical to the fault-free run."""
    report = drill(tmp_path, "--procs-per-node", "1", "--fail", fail, "--at-step", "19", overrides=MOE_DRILL)
    assert report["ok"], report["stdout"]
    (rec,) = report["recoveries"]
    assert rec["failure_class"] == fail and rec["bytes_tier3"] == 0 and rec["version"] == 10, rec
    assert rec["rank_tiers"] == [["tier1"], ["tier2"] if fail == "node" else ["tier1"]], rec
    assert report["final_digest"] == moe_reference


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rack_failure_recovers_from_tier3(tmp_path, drill_reference):
    """With a base every 10 steps and checkpoint.remote.base_every=2, node memory had bases 0 and 10 and Tier-3
    base 0 only: the rack recovery replays from base 0 through the skipped base 10 (diffs go to Tier-3 every
    batch), bit-identical."""
    overrides = [*DRILL, "checkpoint.base_interval=10", "checkpoint.remote.base_every=2"]
    report = drill(tmp_path, "--fail", "rack", "--at-step", "17", overrides=overrides)
    assert report["ok"], report["stdout"]
    (rec,) = report["recoveries"]
    assert rec["failure_class"] == "rack" and all(t == ["tier3"] for t in rec["rank_tiers"])
    assert rec["bytes_tier1"] == rec["bytes_tier2"] == 0 < rec["bytes_tier3"]
    assert rec["version"] == 0 and rec["end"] >= 10, rec  # base 10 never went to Tier-3, batch 6-10 did
    assert report["final_digest"] == drill_reference
    # The relaunch counts from its anchor E: E goes to Tier-3, E + 10 does not.
    bases = RemoteReader(open_remote_store(str(tmp_path / "work" / JOB / "remote"), JOB), JOB).committed_bases()
    assert rec["end"] in bases and rec["end"] + 10 not in bases, bases


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_spread_base_recovers_bit_identical(tmp_path, drill_reference):
    """Base 20 captured in 4 parts during steps 18-21 (the schedule) and reconciled by replay; a failure at 27
    restores from it."""
    report = drill(tmp_path, "--fail", "software", "--at-step", "27",
                   overrides=[*DRILL, "checkpoint.base_capture=spread", "checkpoint.capture_steps=4"])
    assert report["ok"], report["stdout"]
    (rec,) = report["recoveries"]
    assert rec["version"] == 20 and rec["bytes_tier3"] == 0
    assert report["final_digest"] == drill_reference


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_flipped_byte_in_a_tier1_base_falls_through_and_stays_exact(tmp_path, drill_reference):
    report = drill(tmp_path, "--fail", "software", "--corrupt", "--at-step", "19")
    assert report["ok"], report["stdout"]
    (rec,) = report["recoveries"]
    assert any("base v0" in f and "xxh64" in f for f in rec["fallbacks"]), rec["fallbacks"]
    assert sum(t != ["tier1"] for t in rec["rank_tiers"]) == 1  # only the corrupted rank looked elsewhere
    assert report["final_digest"] == drill_reference


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_adaptive_compression_with_a_failure_every_100_steps_ends_within_1pct(tmp_path):
    """The demo model (``small``) for 300 steps, shorter sequences to fit the suite's budget.

    "Final loss" is the validation loss at step 300 over fixed held-out batches: one training batch's loss swings
    by more than 1% between neighbouring steps, so it cannot tell a lossy recovery from batch noise.
    The failures fall mid-way through a base interval (bases every 50 steps, counted from each restart, which
    writes a base: 100 -> fail at 125, restart base 124 -> 224 -> fail at 250), so each recovery replays the
    lossy diff chain a failure at a random point replays on average (~25 steps), not the longest one.
    Lossy records carry error feedback; without it this drill ended 2.4% off, with it 0.79% (measured).
    """
    overrides = ["model=small", "train.iters=300", "data.seq_len=64", "train.global_batch_size=8",
                 "train.micro_batch_size=4", "train.eval_iters=8", "logging.wandb.mode=disabled"]
    report = drill(tmp_path, "--nodes", "2", "--procs-per-node", "1", "--fail", "software", "--at-step", "125",
                   "250", "--compare", overrides=overrides)
    assert report["ok"], report["stdout"]
    assert len(report["recoveries"]) == 2 and all(r["failure_class"] == "software" for r in report["recoveries"])
    chains = [(r.get("version"), r.get("end")) for r in report["recoveries"]]
    assert abs(report["final_val_loss"] - report["reference_val_loss"]) <= 0.01 * report["reference_val_loss"], \
        (report["final_val_loss"], report["reference_val_loss"], chains)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("nodes,procs,tp,batch", [pytest.param(3, 1, 1, 12, id="3x1-to-2x1", marks=pytest.mark.slow),
                                                   pytest.param(2, 2, 2, 4, id="2x2-to-1x2", marks=pytest.mark.slow)])
def test_node_lost_without_a_spare_carries_on_resharded(tmp_path, nodes, procs, tp, batch):
    """Elastic continuation: the job relaunches on the survivors with a smaller dp; the lost node's ranks come
    from their replicas on the survivors, nothing from Tier-3, and the state at E equals the fault-free run's
    there (canonical digest: the layout changed)."""
    overrides = [o for o in DRILL if not o.startswith(("parallel.tp=", "train.global_batch_size="))]
    overrides += [f"parallel.tp={tp}", f"train.global_batch_size={batch}"]
    report = drill(tmp_path, "--nodes", str(nodes), "--procs-per-node", str(procs), "--fail", "node",
                   "--no-spare", "--at-step", "19", "--compare", overrides=overrides)
    assert report["ok"], report["stdout"]
    (rec,) = report["recoveries"]
    assert rec["resharded"] == f"({tp},1,{nodes * procs // tp}) -> ({tp},1,{(nodes - 1) * procs // tp})"
    assert rec["bytes_tier3"] == 0
    assert rec["canonical_digest"] == report["reference_canonical_digest"]
    assert rec["end"] >= 19 - 2


def test_drill_refuses_bad_arguments(tmp_path):
    cmd = [sys.executable, str(REPO / "scripts" / "failure_drill.py"), "--fail", "node", "--nodes", "1",
           "--at-step", "3", "--", "model=tiny"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "needs --nodes >= 2" in proc.stderr
    cmd = [sys.executable, str(REPO / "scripts" / "failure_drill.py"), "--fail", "software", "--at-step", "50",
           "--work-dir", str(tmp_path), "--", "model=tiny", "train.iters=20"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "must be below train.iters=20" in proc.stderr


# ---- every crash point ------------------------------------------------------------------------------

# (point, armed step): each fires within the first launch's 30 steps.
CRASHES = [("t1.mid_write", 12), ("t2.mid_chunk", 10), ("t3.before_marker", 10), ("t3.before_commit", 10),
           ("t3.after_commit_before_watermark", 10), ("gc.mid_delete", 12)]


def _committed_and_loadable(work: Path) -> set:
    """Every committed unit on Tier-3, each loaded and checksum-verified for every rank (raises otherwise)."""
    reader = RemoteReader(open_remote_store(str(work / "remote"), JOB), JOB)
    committed = set()
    for unit in reader.committed():
        for rank in range(2):
            reader.load(unit.pid, rank)
        committed.add(unit.pid)
    return committed


def _crash_then_recover(work: Path, reference: str, env_first: dict, *, env_second: dict | None = None) -> dict:
    status, seconds = run_job(work, POINTS, nodes=2, procs=1, env=env_first, fail_grace_s=120)
    # The survivor must notice on its own (gloo errors or collective timeouts), not by the launcher's grace.
    assert status != 0 and seconds < 100, (status, seconds)
    committed = _committed_and_loadable(work)
    if env_second is not None:
        status, seconds = run_job(work, POINTS, nodes=2, procs=1, env=env_second, fail_grace_s=120)
        assert status != 0 and seconds < 100, (status, seconds)
        assert committed <= _committed_and_loadable(work)
    status, _ = run_job(work, POINTS, nodes=2, procs=1)
    assert status == 0
    recovery = [r for r in records(work) if r.get("event") == "recovery"]
    assert recovery, "the relaunch did not recover"
    # Exact state: nothing uncommitted or half-written was used, nothing committed and needed was lost.
    assert summary(work)["state_digest"] == reference
    newest = max((p.version for p in committed if p.kind == "base"), default=None)
    assert newest is None or recovery[0]["version"] >= newest  # a committed base is never given up
    return recovery[0]


@pytest.mark.timeout(400)
# One crash point in `make test`, the others in `make test-slow`.
@pytest.mark.parametrize("point,step", [pytest.param(p, s, id=p,
                                                     marks=() if p == "t3.before_marker" else pytest.mark.slow)
                                        for p, s in CRASHES])
def test_crash_point_recovers_exactly_without_hang(tmp_path, points_reference, point, step):
    env = {i: {"MEGATIER_CRASH_AT": f"{point}:{step}"} for i in range(2)}
    _crash_then_recover(tmp_path, points_reference, env)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_crash_during_replay_recovers_on_the_next_launch(tmp_path, points_reference):
    first = {i: {"MEGATIER_CRASH_AT": "train.step_end:17"} for i in range(2)}
    during_replay = {1: {"MEGATIER_CRASH_AT": "replay.mid_batch:0"}}
    record = _crash_then_recover(tmp_path, points_reference, first, env_second=during_replay)
    assert record["end"] >= 12


@pytest.fixture
def loaded_machine():
    """Two busy processes beside the job for its whole run (this box has two cores): the save thread, the
    replicator and the uploader fall behind the loop unless the loop waits for what a bound depends on."""
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield
    for proc in busy:
        proc.kill()
        proc.wait()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("fail, most", [pytest.param("software", 1, marks=pytest.mark.slow), ("node", 2)])
def test_the_steps_lost_bound_holds_on_a_loaded_machine(tmp_path, drill_reference, loaded_machine, fail, most):
    report = drill(tmp_path, "--fail", fail, "--at-step", "17")
    assert report["ok"], report["stdout"]
    (rec,) = report["recoveries"]
    assert rec["failure_class"] == fail and rec["steps_lost_drill"] <= most, rec
    assert report["final_digest"] == drill_reference


@pytest.mark.timeout(400)
def test_a_flipped_parameter_replica_is_named_healed_and_its_base_never_committed(tmp_path):
    """dp=3: after step 10's all-gather one bit of rank 2's parameters flips. The replica check at step 10 names
    rank 2, gathers the parameters again (the run ends bit-identical to one without the flip), and base 10 (the
    base of that interval) is never committed to Tier-3."""
    job = ["model=tiny", "train.iters=14", "checkpoint=tiered", "checkpoint.base_interval=10",
           "checkpoint.diff.compression=fp32", "logging.wandb.mode=disabled", "logging.progress=false",
           f"checkpoint.job_id={JOB}", "data.seq_len=64", "train.global_batch_size=6", "train.micro_batch_size=2",
           "parallel.timeout_s=30", "reliability.replica_check_interval=5"]
    digests = {}
    for name, env in (("clean", None), ("flipped", {0: {"MEGATIER_PARAM_FLIP_AT": "10:2"}})):
        status, _ = run_job(tmp_path / name, job, nodes=1, procs=3, env=env)
        assert status == 0
        steps = {r["step"]: r for r in records(tmp_path / name) if "loss" in r and r.get("event") is None}
        digests[name] = summary(tmp_path / name)["state_digest"]
        bases = RemoteReader(open_remote_store(str(tmp_path / name / "remote"), JOB), JOB).committed_bases()
        if name == "flipped":
            assert steps[10]["replica_mismatch"] == [2] and all("replica_mismatch" not in steps[s] for s in (5, 14))
            assert 10 not in bases and 0 in bases, bases
        else:
            assert 10 in bases, bases
    assert digests["flipped"] == digests["clean"]
