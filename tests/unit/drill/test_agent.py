"""megatier-agent's node agent: ranks and spares get their ids and environment, a failed process is reported dead
and counts as replaced once a later round formed a world, a process a round left out is stopped."""
from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from megatier.launcher.agent import NodeAgent, run_prefix, serve_store
from megatier.parallel.assignment import Assignment
from megatier.parallel.membership import MembershipRound, Outcome

pytestmark = pytest.mark.timeout(60)

# Each child writes its environment, then: rank 1 fails with the status given (1: a crash), a process named in
# HANG sleeps, the rest end well.
SCRIPT = """
import json, os, sys, time
env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MEGATIER_MEMBER_ID",
                                        "MEGATIER_SPARE", "MEGATIER_NODE_NAME", "MEGATIER_CRASH_AT")}
with open(os.path.join(sys.argv[1], env["MEGATIER_MEMBER_ID"].replace("/", "_") + ".json"), "w") as f:
    json.dump(env, f)
if env["MEGATIER_MEMBER_ID"] in sys.argv[2].split(","):
    time.sleep(60)
sys.exit(int(sys.argv[3]) if env["RANK"] == "1" else 0)
"""


def _agent(tmp_path, store, hang: str = "", status: int = 1) -> NodeAgent:
    return NodeAgent(["-c", SCRIPT, str(tmp_path), hang, str(status)], node="node0", node_rank=0, nodes=1, procs=2,
                     spares=1, store=f"127.0.0.1:{store.port}", run_id="t")


def _finish(agent: NodeAgent) -> None:
    deadline = time.monotonic() + 30
    while agent.poll():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    agent.close()


def _decide(store, epoch: int, holders: tuple[str, ...]) -> None:
    rnd = MembershipRound(store, epoch, run_prefix("t"))
    rnd.store.set(f"{rnd.key}/decision", Outcome(Assignment(1, 1, len(holders), holders)).to_json())
    store.add(f"{run_prefix('t')}/decided", 1)


def test_ranks_and_spares_get_their_place_and_a_failure_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATIER_CRASH_AT", "train.step_end:3:1")
    store = serve_store(0)
    agent = _agent(tmp_path, store)
    agent.start()
    _finish(agent)
    envs = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*.json")}
    assert (envs["node0_0"]["RANK"], envs["node0_1"]["LOCAL_RANK"], envs["node0_1"]["WORLD_SIZE"]) == ("0", "1", "2")
    spare = envs["node0_spare0"]
    assert spare["MEGATIER_SPARE"] == "1" and spare["RANK"] is None and spare["MEGATIER_CRASH_AT"] is None
    assert envs["node0_0"]["MEGATIER_CRASH_AT"] == "train.step_end:3:1"  # only a spare drops the armed crash
    assert all(e["MEGATIER_NODE_NAME"] == "node0" and e["LOCAL_WORLD_SIZE"] == "2" for e in envs.values())
    assert MembershipRound(store, 1, run_prefix("t")).reported_dead() == {"node0/1"}
    assert agent.status(wait_s=0.2) == 1  # no round replaced it
    _decide(store, 1, ("node0/0", "node0/spare0"))
    assert agent.status(wait_s=0.2) == 0


def test_a_process_a_round_left_out_is_stopped_and_counts_as_replaced(tmp_path):
    store = serve_store(0)
    agent = _agent(tmp_path, store, hang="node0/0")
    agent.start()
    while not (tmp_path / "node0_0.json").exists():
        time.sleep(0.05)
    agent.poll()
    _decide(store, 1, ("node0/spare0", "node0/1"))  # the round went on without the hung node0/0
    _finish(agent)
    hung = next(c for c in agent.children if c.member == "node0/0")
    assert hung.process.returncode == -9
    _decide(store, 2, ("node0/spare0", "node0/x"))  # and replaced node0/1, which failed
    assert agent.status(wait_s=0.2) == 0


def test_a_status_the_job_explains_is_its_answer_not_a_death_to_wait_out(tmp_path):
    # A refusal (2) ends the launch at once: no round will replace a process that refused the job.
    store = serve_store(0)
    agent = _agent(tmp_path, store, status=2)
    agent.start()
    _finish(agent)
    started = time.monotonic()
    assert agent.status(wait_s=30.0) == 2
    assert time.monotonic() - started < 5.0


def test_the_node_lease_is_renewed_while_the_agent_is_busy_starting_processes(tmp_path, monkeypatch):
    # A start slowed by load (here: each process takes 1.5 s to spawn) must not let the node's lease run out:
    # the rounds would count the whole node lost before its first world formed.
    store = serve_store(0)
    agent = _agent(tmp_path, store)
    spawn = NodeAgent._spawn
    counts = []

    def slow_spawn(command, env):
        counts.append(store.add(f"{run_prefix('t')}/beat/node0", 0))
        time.sleep(1.5)
        return spawn(command, env)

    monkeypatch.setattr(agent, "_spawn", slow_spawn)
    agent.start()
    assert counts[0] >= 1 and counts[-1] - counts[0] >= 4  # beaten every 0.5 s through 3 s of spawning
    _finish(agent)


def test_a_stopped_process_is_killed_by_the_watchdog_and_reported(tmp_path, capsys):
    store = serve_store(0)
    agent = NodeAgent(["-c", SCRIPT, str(tmp_path), "node0/0", "0"], node="node0", node_rank=0, nodes=1, procs=2,
                      spares=0, store=f"127.0.0.1:{store.port}", run_id="t", hang_timeout_s=0.5)
    agent.start()
    hung = agent.children[0]
    while not (tmp_path / "node0_0.json").exists():  # it is in its sleep now
        time.sleep(0.05)
    os.kill(hung.process.pid, signal.SIGSTOP)
    _finish(agent)
    assert hung.process.returncode == -signal.SIGKILL and agent.children[1].process.returncode == 0
    assert MembershipRound(store, 1, run_prefix("t")).reported_dead() == {"node0/0"}
    err = capsys.readouterr().err
    assert re.search(r"node0/0 \(rank 0, pid \d+\) has been stopped for \d+\.\d s \(frozen\); killing it", err), err
