"""The agent's hang watchdog: a frozen process (stopped: no thread runs) is killed and reported dead after the
timeout, a process waiting without the interpreter lock (as in a collective) is not, and silence counts only
while the agent watched."""
from __future__ import annotations

import time

import pytest

from megatier.cli.agent import parse_args
from megatier.launcher import watchdog
from megatier.launcher.agent import NodeAgent, run_prefix, serve_store
from megatier.parallel.membership import MembershipRound

pytestmark = pytest.mark.timeout(60)

# Each child beats as a training process does; rank 1 then stops itself (frozen), the spare waits in a sleep,
# which holds no interpreter lock, as a rank blocked in a collective does not, and rank 0 runs its exit handlers
# first (they stop its beat) and then takes its time to end, as a process finalizing its process groups may.
SCRIPT = """
import atexit, os, signal, sys, time
from megatier.launcher.watchdog import start_beating
start_beating()  # beats only when its agent's watchdog is on
open(os.path.join(sys.argv[1], os.environ["MEGATIER_MEMBER_ID"].replace("/", "_")), "w").close()
if os.environ.get("RANK") == "1":
    time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGSTOP)
if os.environ.get("RANK") == "0":
    time.sleep(1.0)
    atexit._run_exitfuncs()
time.sleep(float(sys.argv[2]))
"""


def _agent(tmp_path, store, hang_timeout_s: float, wait_s: float = 15.0) -> NodeAgent:
    return NodeAgent(["-c", SCRIPT, str(tmp_path), str(wait_s)], node="node0", node_rank=0, nodes=1, procs=2,
                     spares=1, store=f"127.0.0.1:{store.port}", run_id="t", hang_timeout_s=hang_timeout_s)


def _child(agent: NodeAgent, member: str):
    return next(c for c in agent.children if c.member == member)


def test_a_frozen_process_is_killed_and_a_waiting_or_exiting_one_is_left_alone(tmp_path):
    store = serve_store(0)
    agent = _agent(tmp_path, store, hang_timeout_s=4.0)  # a loaded box delays a beat by a second, not four
    agent.start()
    frozen = _child(agent, "node0/1")
    deadline = time.monotonic() + 40
    while frozen.process.poll() is None:
        assert time.monotonic() < deadline, "the frozen rank was never killed"
        agent.poll()
        time.sleep(0.05)
    agent.poll()
    assert frozen.process.returncode == -9
    assert MembershipRound(store, 1, run_prefix("t")).reported_dead() == {"node0/1"}
    # The spare beats on while it waits; rank 0 closed its pipe as it began to exit, silent since, and is not
    # judged: both end on their own.
    assert _child(agent, "node0/0").process.poll() is None and _child(agent, "node0/spare0").process.poll() is None
    while agent.poll():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert _child(agent, "node0/0").process.returncode == 0 and _child(agent, "node0/spare0").process.returncode == 0


def test_with_the_watchdog_off_a_frozen_process_is_left_to_the_collective_timeout(tmp_path):
    store = serve_store(0)
    agent = _agent(tmp_path, store, hang_timeout_s=0.0, wait_s=4.0)
    agent.start()
    frozen = _child(agent, "node0/1")
    assert frozen.beats is None
    deadline = time.monotonic() + 40
    while _child(agent, "node0/0").process.poll() is None:
        assert time.monotonic() < deadline
        agent.poll()
        time.sleep(0.05)
    assert frozen.process.poll() is None  # still stopped
    agent.stop(9)
    frozen.process.wait()


def test_silence_counts_only_from_the_first_beat_and_while_the_agent_watched(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(watchdog.time, "monotonic", lambda: clock[0])
    dog = watchdog.Watchdog(hang_timeout_s=3.0)
    beats, env, fds = dog.pipe()
    write_end = fds[0]
    try:
        assert dog.silence(beats, dog.look()) is None  # not beating yet: never judged
        watchdog.os.write(write_end, b".")
        assert dog.silence(beats, dog.look()) is None and beats.last == 100.0
        clock[0] = 101.0
        dog.look()
        clock[0] = 110.0  # the agent was not scheduled for 9 s: a loaded box stalls it and its processes alike
        assert dog.silence(beats, dog.look()) is None
        for _ in range(4):  # now it watches, in steps shorter than its gap
            clock[0] += 1.0
            silent = dog.silence(beats, dog.look())
        assert silent == pytest.approx(4.0)
        watchdog.os.write(write_end, b".")
        assert dog.silence(beats, dog.look()) is None  # beating again
        watchdog.os.close(write_end)  # its exit handler closed the pipe: no longer judged, however long it takes
        write_end = None
        clock[0] += 60.0
        assert dog.silence(beats, dog.look()) is None and beats.exiting
    finally:
        beats.close()
        if write_end is not None:
            watchdog.os.close(write_end)
    assert env == {watchdog.ENV_BEAT_FD: str(fds[0])}


def test_a_process_no_agent_started_does_not_beat_and_a_bad_timeout_is_refused(monkeypatch, capsys):
    monkeypatch.delenv(watchdog.ENV_BEAT_FD, raising=False)
    assert watchdog.start_beating() is False
    assert watchdog.Watchdog(0).pipe() == (None, {}, ())
    with pytest.raises(SystemExit):
        parse_args(["--hang-timeout-s", "-1", "--store", "h:1", "--", "train.py"])
    assert "--hang-timeout-s -1 must be >= 0 (0 turns the hang watchdog off)" in capsys.readouterr().err
