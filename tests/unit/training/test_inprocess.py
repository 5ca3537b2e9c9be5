"""In-process recovery's pieces that need no world: member ids, which processes recover in place, the
environment of a process that takes a rank, and a spare's wait for one."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatier.config import RecoveryConfig
from megatier.launcher.agent import run_prefix
from megatier.parallel.assignment import Member
from megatier.parallel.membership import MembershipRound, beat
from megatier.training import inprocess
from megatier.training.inprocess import Membership, become_rank, member_of, store_address


def test_a_member_id_names_its_node():
    assert member_of("node1/spare0") == Member("node1/spare0", "node1")
    assert member_of("host-a.cluster/3").node == "host-a.cluster"
    with pytest.raises(ValueError, match="<node>/<slot>"):
        member_of("node1")


def test_only_inprocess_mode_with_a_known_store_recovers_in_place(monkeypatch):
    monkeypatch.delenv(inprocess.ENV_STORE, raising=False)
    assert store_address(RecoveryConfig()) is None  # torchrun: no store, a failure ends the launch
    assert store_address(RecoveryConfig(store="h:1")) == "h:1"
    monkeypatch.setenv(inprocess.ENV_STORE, "agent:2")
    assert store_address(RecoveryConfig()) == "agent:2"
    assert store_address(RecoveryConfig(mode="relaunch", store="h:1")) is None


def test_a_spare_takes_the_local_rank_of_its_place_on_its_node(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(key, "")
    m = Membership(store=None, me=member_of("node2/spare1"), prefix="p", cfg=RecoveryConfig())
    m.world = [member_of(i) for i in ("node0/0", "node0/1", "node2/spare0", "node2/spare1")]
    become_rank(m, 3)
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("3", "4", "1")


def test_a_spare_waits_through_rounds_until_one_gives_it_a_rank(monkeypatch):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    monkeypatch.setenv(inprocess.ENV_MEMBER, "node0/spare0")
    monkeypatch.setenv(inprocess.ENV_RUN, "r1")
    cfg = RecoveryConfig(store=f"127.0.0.1:{server.port}")
    spare = Membership.connect(cfg, timeout_s=30)
    got = {}
    waiter = threading.Thread(target=lambda: got.update(rank=spare.await_rank()))
    waiter.start()
    world = [Member(f"node{n}/0", f"node{n}") for n in range(2)]
    prefix = run_prefix("r1")
    first = MembershipRound(server, 1, prefix)  # a round with a spare elsewhere: this one stays idle
    first.join(Member("node9/spare0", "node9"), survivor=False)
    first.report_dead("node1/0")
    _wait_for_members(first, 2)  # both spares joined
    assert first.join(world[0], survivor=True)
    first.decide((1, 1, 2), world, deadline_s=5, shrink=False)
    second = MembershipRound(server, 2, prefix)  # the next failure: this spare is the only one
    second.report_dead("node0/0")
    new_world = list(first.outcome(5).assignment.holders)
    survivor = member_of(new_world[1])
    _wait_for_members(second, 1)  # the idle spare moved on to the next round
    assert second.join(survivor, survivor=True)
    second.decide((1, 1, 2), [member_of(h) for h in new_world], deadline_s=5, shrink=False)
    waiter.join(30)
    assert got == {"rank": 0} and spare.epoch == 2 and spare.assigned_at is not None


def _wait_for_members(rnd: MembershipRound, n: int) -> None:
    deadline = time.monotonic() + 20
    while len(rnd.members()) < n:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_an_idle_spare_stops_waiting_when_the_job_ends(monkeypatch):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    monkeypatch.setenv(inprocess.ENV_MEMBER, "node0/spare0")
    cfg = RecoveryConfig(store=f"127.0.0.1:{server.port}")
    spare = Membership.connect(cfg, timeout_s=30)
    MembershipRound.finish(server, spare.prefix)
    assert spare.await_rank() is None


@pytest.mark.parametrize("lost", ["reported", "lease"])
def test_a_spare_ends_with_a_round_failure_when_every_rank_of_the_job_is_lost(monkeypatch, lost):
    """Every rank died at once (a rack, or each reported by its agent): no survivor will start a round, so a
    spare must not wait for one forever; a machine whose agent stopped beating counts as lost with its ranks."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    monkeypatch.setenv(inprocess.ENV_MEMBER, "node2/spare0")
    cfg = RecoveryConfig(store=f"127.0.0.1:{server.port}", node_lease_s=0.5)
    spare = Membership.connect(cfg, timeout_s=30)
    world = ["node0/0", "node0/1", "node1/0", "node1/1"]
    MembershipRound(server, 0, spare.prefix).publish_world(world)
    if lost == "reported":
        for member in world:
            MembershipRound(server, 0, spare.prefix).report_dead(member)
    else:
        for node in ("node0", "node1", "node2"):
            beat(server, spare.prefix, node)  # node0 and node1 beat once, then their agents die
        threading.Thread(target=lambda: [beat(server, spare.prefix, "node2") or time.sleep(0.1)
                                         for _ in range(40)], daemon=True).start()
    started = time.monotonic()
    with pytest.raises(inprocess.RoundFailed, match="every rank of the job was lost at once"):
        spare.await_rank()
    assert time.monotonic() - started < 3.0


def test_a_spare_keeps_waiting_while_a_rank_of_the_job_lives(monkeypatch):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    monkeypatch.setenv(inprocess.ENV_MEMBER, "node0/spare0")
    spare = Membership.connect(RecoveryConfig(store=f"127.0.0.1:{server.port}"), timeout_s=30)
    MembershipRound(server, 0, spare.prefix).publish_world(["node0/0", "node1/0"])
    MembershipRound(server, 0, spare.prefix).report_dead("node1/0")
    threading.Timer(1.0, MembershipRound.finish, args=(server, spare.prefix)).start()
    assert spare.await_rank() is None  # waited until the job ended, not a failure


@pytest.mark.parametrize("shrink", [True, False])
def test_without_a_spare_the_broken_replicas_survivor_becomes_a_spare_or_the_round_fails(shrink):
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    world = [member_of(f"node{n}/{i}") for n in range(2) for i in range(2)]  # tp=2 x dp=2, replica d on node d
    cfg = RecoveryConfig(store=f"127.0.0.1:{server.port}", round_timeout_s=10, shrink=shrink)
    MembershipRound(server, 1, "p").report_dead("node0/1")
    got = {}

    def survive(member):
        client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))
        m = Membership(client, member, "p", cfg, world=list(world))
        try:
            got[member.id] = (m.survive((2, 1, 2), dp_ok=lambda dp: True), m.world)
        except inprocess.RoundFailed as e:
            got[member.id] = e

    threads = [threading.Thread(target=survive, args=(m,)) for m in (world[0], world[2], world[3])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if not shrink:
        assert all(isinstance(v, inprocess.RoundFailed) and "recovery.shrink=false" in str(v) for v in got.values())
        return
    kept = [member_of("node1/0"), member_of("node1/1")]
    assert got == {"node0/0": (None, world), "node1/0": (0, kept), "node1/1": (1, kept)}


@pytest.mark.parametrize("env,title", [({"MEGATIER_MEMBER_ID": "node1/spare0", "MEGATIER_SPARE": "1"},
                                        "megatier node1/spare0 spare"),
                                       ({"MEGATIER_MEMBER_ID": "node1/1", "RANK": "3"}, "megatier node1/1 rank 3"),
                                       ({"RANK": "2"}, "megatier rank 2")])
def test_ps_tells_ranks_and_spares_apart(env, title):
    code = ("from megatier.training.inprocess import name_process; name_process(); "
            "print(open('/proc/self/cmdline').read())")
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "MEGATIER_MEMBER_ID", "MEGATIER_SPARE")}
    out = subprocess.run([sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip("\x00\n") == title, out.stderr


def test_the_agent_says_which_process_died_and_how():
    from megatier.launcher.agent import Child, death

    child = Child("node1/0", subprocess.Popen([sys.executable, "-c", "pass"]), rank=2)
    child.process.wait()
    assert child.describe() == f"node1/0 (rank 2, pid {child.process.pid})"
    assert death(-9) == "was killed by SIGKILL" and death(1) == "exited with status 1"
    assert Child("node1/spare0", child.process).describe().startswith("node1/spare0 (spare, pid ")


def test_a_clean_stop_is_not_reported_as_a_death(monkeypatch):
    from megatier.launcher.agent import Child, NodeAgent

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    agent = NodeAgent(["-c", "pass"], node="node0", node_rank=0, nodes=1, procs=0, spares=1,
                      store=f"127.0.0.1:{server.port}", run_id="t")
    agent.store = server
    for code in (130, 143, 1):
        process = subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"])
        agent.children.append(Child(f"node0/{code}", process, rank=0))
    for child in agent.children:
        child.process.wait()
    agent.poll()
    assert MembershipRound(server, 0, run_prefix("t")).reported_dead() == {"node0/1"}


def test_a_failed_launch_is_announced_by_one_process_whatever_its_rank(monkeypatch, capsys):
    """Rank 0 may be among the lost: the first process to learn that the job cannot be re-formed says so, the
    others end with the same status and say nothing."""
    from megatier.training import outcome

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    ends = []
    for member in ("node1/0", "node1/1", "node2/spare0"):
        monkeypatch.setenv(inprocess.ENV_MEMBER, member)
        monkeypatch.setenv("RANK", "2")  # not rank 0
        error = Membership.connect(RecoveryConfig(store=f"127.0.0.1:{server.port}"), timeout_s=30).failed("why")
        ends.append(outcome.refuse(*outcome.refusal(error), error.announce))
    assert ends == [outcome.EXIT_REFORM_FAILED] * 3
    assert capsys.readouterr().err.count("in-process recovery could not re-form the job: why;") == 1
    left_out = inprocess.RoundFailed("this process was left out of the re-formed job", announce=False)
    monkeypatch.setenv("RANK", "0")
    outcome.refuse(*outcome.refusal(left_out), left_out.announce)  # the job goes on: nothing to announce
    assert capsys.readouterr().err == ""
