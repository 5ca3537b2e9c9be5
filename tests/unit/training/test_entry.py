"""The training command as a user meets it: refusals are one line with their exit status, Ctrl-C stops cleanly,
a relaunch through another launcher finds its node memory, a finished job's relaunch is no failure."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from megatier.observe.run_history import RunHistory
from tests.conftest import REPO
from tools.chaos.s3_proxy import FaultRule, S3FaultProxy

pytestmark = pytest.mark.timeout(240)


def _common(tmp_path, corpus_prefix, name: str = "entry") -> list[str]:
    return ["model=tiny", f"data.prefix={corpus_prefix}", "data.seq_len=64", "train.global_batch_size=4",
            "train.micro_batch_size=2", "train.eval_interval=1000", "logging.wandb.mode=disabled",
            "logging.progress=false", f"logging.name={name}", f"logging.run_dir={tmp_path}/run",
            "checkpoint=tiered", "checkpoint.tiers=[local]", f"checkpoint.local.root={tmp_path}/shm",
            "checkpoint.diff.compression=fp32", "checkpoint.base_interval=10", "checkpoint.base_capture=snapshot"]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "MEGATIER_NODE_NAME", "GROUP_RANK")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra)
    return env


def _train(args: list[str], *, launcher: str = "python", env: dict | None = None) -> subprocess.CompletedProcess:
    if launcher == "python":
        cmd = [sys.executable, "-m", "megatier.train", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
               "-m", "megatier.train", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env or _env(), cwd=REPO, timeout=200)


def _records(run_dir: str, name: str = "metrics.jsonl") -> list[dict]:
    with open(os.path.join(run_dir, name)) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_an_unknown_key_is_one_line_and_exit_2_with_or_without_plus():
    for override in ("+train.iter=5", "train.iter=5"):
        proc = _train(["model=tiny", override])
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip() == (f"config error: unknown config key train.iter (in the override "
                                       f"'{override}'); did you mean train.iters?")


@pytest.mark.parametrize("first,second", [("python", "torchrun"), ("torchrun", "python")])
def test_a_relaunch_through_another_launcher_resumes_from_node_memory(tmp_path, corpus_prefix, first, second):
    args = _common(tmp_path, corpus_prefix)
    assert _train([*args, "train.iters=6"], launcher=first).returncode == 0
    proc = _train([*args, "train.iters=9"], launcher=second)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rec = next(r for r in _records(f"{tmp_path}/run") if r.get("event") == "recovery")
    assert (rec["version"], rec["end"], rec["steps_lost"]) == (6, 6, 0)  # the final base of the first launch
    assert rec["source_tiers"] == {"tier1": 1, "tier2": 0, "tier3": 0}
    assert rec["failure_class"] == "none"  # the first launch ended cleanly: this one continues the job
    assert os.listdir(f"{tmp_path}/shm/entry") == [os.uname().nodename]


def test_node_memory_under_another_node_name_is_adopted(tmp_path, corpus_prefix):
    args = _common(tmp_path, corpus_prefix)
    assert _train([*args, "train.iters=6"], env=_env(MEGATIER_NODE_NAME="node0")).returncode == 0
    proc = _train([*args, "train.iters=8"])  # the hostname now: the area filed as node0 is this machine's
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "was filed under node name 'node0'" in proc.stdout
    rec = next(r for r in _records(f"{tmp_path}/run") if r.get("event") == "recovery")
    assert (rec["end"], rec["steps_lost"]) == (6, 0)


def test_ambiguous_node_memory_stops_the_launch_instead_of_starting_fresh(tmp_path, corpus_prefix):
    args = _common(tmp_path, corpus_prefix)
    proc = _train([*args, "train.iters=4"], env=_env(MEGATIER_NODE_NAME="node0"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    shutil.copytree(f"{tmp_path}/shm/entry/node0", f"{tmp_path}/shm/entry/node1")  # which one is this machine's?
    proc = _train([*args, "train.iters=6"])
    assert proc.returncode == 4, proc.stdout[-2000:] + proc.stderr[-2000:]  # recovery refused, one line
    assert "node0, node1" in proc.stdout and "MEGATIER_NODE_NAME" in proc.stdout
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "starting fresh" not in proc.stdout


def test_a_changed_config_is_refused_in_one_line(tmp_path, corpus_prefix):
    args = _common(tmp_path, corpus_prefix)
    assert _train([*args, "train.iters=4"]).returncode == 0
    proc = _train([*args, "train.iters=6", "optim.lr=1e-2"])
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert "optim.lr" in proc.stderr and "checkpoint.allow_changes=[optim.lr]" in proc.stderr


def test_an_init_from_of_another_shape_is_refused_in_one_line(tmp_path, corpus_prefix):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=300, n_positions=64, bos_token_id=0,
                        eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "hf")
    proc = _train([*_common(tmp_path, corpus_prefix), "train.iters=2", f"model.init_from={tmp_path}/hf"])
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr[-2000:]
    assert "n_layer=1" in proc.stderr and "set model.num_layers=1" in proc.stderr


def test_ctrl_c_stops_after_the_step_and_says_where_to_resume(tmp_path, corpus_prefix):
    args = _common(tmp_path, corpus_prefix)
    cmd = [sys.executable, "-m", "megatier.train", *args, "train.iters=100000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=REPO)
    metrics = f"{tmp_path}/run/metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    summary = _records(f"{tmp_path}/run")[-1]
    step = summary["step"]
    assert f"interrupted at step {step}; relaunch the same command to resume from step {step}" in err
    assert summary["checkpoint_saved_step"] == step  # drained: the step is durable
    again = _train([*args, f"train.iters={step + 2}"])
    rec = next(r for r in _records(f"{tmp_path}/run") if r.get("event") == "recovery")
    assert again.returncode == 0 and (rec["end"], rec["steps_lost"]) == (step, 0)


def test_a_finished_job_relaunched_says_so_and_is_no_failure(tmp_path, corpus_prefix):
    args = [*_common(tmp_path, corpus_prefix), "train.iters=7"]
    first = _train(args)
    assert first.returncode == 0
    digest = _records(f"{tmp_path}/run")[-1]["state_digest"]
    again = _train(args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "had already finished: its checkpoints are at step 7 and train.iters=7" in again.stdout
    assert "loss nan" not in again.stdout and digest in again.stdout  # the final base: the same state
    with open(f"{tmp_path}/run/goodput.json") as f:
        ledger = json.load(f)
    assert ledger["restarts"] == 0 and ledger["steps_lost"] == 0
    assert RunHistory.read(f"{tmp_path}/run").recoveries == []


def test_a_diverging_run_stops_in_one_line_with_exit_5_and_its_last_finite_step_durable(tmp_path, corpus_prefix):
    """A learning rate of 1e4 blows the loss up at step 2: that step is neither applied nor checkpointed (its
    gradient's squares overflow fp32), the run stops there, and a relaunch resumes bit-exactly from step 1."""
    args = _common(tmp_path, corpus_prefix) + ["train.iters=30", "optim.lr=1e4", "optim.min_lr=1e4",
                                               "optim.warmup_iters=0", "optim.clip_grad=0"]
    proc = _train(args)
    assert proc.returncode == 5, proc.stderr
    (line,) = [s for s in proc.stderr.splitlines() if s.startswith("stopped: ")]
    assert line.startswith("stopped: step 2: the gradient is not finite or its square overflows fp32 (loss ")
    assert "first such tensor: rank 0: " in line and line.endswith("checkpoints are durable at step 1")
    assert "Traceback" not in proc.stderr
    summary = _records(f"{tmp_path}/run")[-1]
    assert summary["event"] == "summary" and summary["step"] == 1 and summary["checkpoint_saved_step"] == 1
    again = _train(args + ["reliability.on_nonfinite=skip_step", "reliability.max_consecutive_skips=3"])
    assert again.returncode == 5, again.stderr
    assert "recovered" in again.stdout and "E=1" in again.stdout
    assert "step 2: the gradient is not finite" in again.stdout  # skipped, logged, nothing applied
    assert again.stderr.strip().endswith("the run diverged after step 1; lower optim.lr or optim.clip_grad and "
                                         "relaunch; checkpoints are durable at step 4")


def test_a_job_that_diverges_after_every_restore_stops_with_exit_6_instead_of_looping(tmp_path, corpus_prefix):
    """The run diverges at step 2 whatever it restores: the relaunch restores step 1 and diverges again, the
    next takes the base before it (step 0) on its own and diverges again, and with no Tier-3 base older than
    that the launch after stops in one line with exit 6 instead of restoring into the loop once more."""
    args = _common(tmp_path, corpus_prefix) + ["train.iters=30", "optim.lr=1e4", "optim.min_lr=1e4",
                                               "optim.warmup_iters=0", "optim.clip_grad=0",
                                               "reliability.loop_limit=1"]
    assert _train(args).returncode == 5  # a fresh start: not a restore, not counted
    assert _train(args).returncode == 5  # restored step 1, diverged at step 2: one loop
    fallback = _train(args)
    assert fallback.returncode == 5 and "restore loop" in fallback.stderr + fallback.stdout
    assert "recovered v0 -> E=0" in fallback.stdout  # the previous base on its own; step 1 trained again
    stopped = _train(args)
    assert stopped.returncode == 6, stopped.stderr[-2000:]
    (line,) = [s for s in stopped.stderr.splitlines() if s.startswith("restore loop: ")]
    assert "(v1->E=1 (failed after step 1), v0->E=0 (failed after step 1))" in line and "step 2 itself" in line
    assert "Traceback" not in stopped.stderr


def test_a_run_whose_tier3_stayed_behind_exits_3_and_says_what_is_durable(tmp_path, corpus_prefix, s3_url):
    url, endpoint = s3_url
    proxy = S3FaultProxy(endpoint).start()
    args = [a for a in _common(tmp_path, corpus_prefix) if not a.startswith("checkpoint.tiers=")]
    args += ["checkpoint.tiers=[local,remote]", f"checkpoint.remote.url={url}",
             f"checkpoint.remote.endpoint_url={proxy.url}", "checkpoint.remote.drain_timeout_s=3",
             "checkpoint.remote.lease_s=3", "train.iters=300"]
    cmd = [sys.executable, "-m", "megatier.train", *args]
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                                cwd=REPO)
        metrics = f"{tmp_path}/run/metrics.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:  # Tier-3 goes down after a few steps
            if os.path.exists(metrics) and sum(1 for _ in open(metrics)) > 3:
                break
            time.sleep(0.05)
        proxy.set_rule(FaultRule("reset"))
        out, err = proc.communicate(timeout=180)
    finally:
        proxy.stop()
    summary = _records(f"{tmp_path}/run")[-1]
    assert proc.returncode == 3, err[-2000:]
    assert summary["step"] == 300 and summary["checkpoint_behind"], summary
    assert "Traceback" not in err
    line = f"checkpoints: Tier-3 is {summary['checkpoint_units_behind']} units behind; the last durable version is"
    assert line in err, err[-2000:]


def test_the_command_ends_with_its_status_without_the_teardown(monkeypatch):
    """torch's C++ objects (process groups, stores, a world left in a recovery) destroyed at the interpreter's
    exit can abort a job that ended well (SIGABRT after its 'done' line): the command ends at once with main's
    status, while main itself, called in a process that goes on, returns it."""
    from megatier import train
    from megatier.training import outcome

    ended = []
    monkeypatch.setattr(train, "run", lambda overrides: 3)
    monkeypatch.setattr(outcome, "exit_skipping_teardown", ended.append)
    monkeypatch.setattr(sys, "argv", ["megatier-train", "model=tiny"])
    assert train.main(["model=tiny"]) == 3 and ended == []
    train.cli()
    assert ended == [3]
