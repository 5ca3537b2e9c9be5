"""The membership round on a real TCPStore: survivors and spares agree on one world, a dead report ends the
wait at once, a hung member is left behind at the deadline, and a late survivor learns it must leave."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from megatier.parallel.assignment import Member
from megatier.parallel.membership import MembershipRound

WORLD = [Member(f"node{n}/{i}", f"node{n}") for n in range(2) for i in range(2)]  # tp=2 x dp=2
SPARE = Member("node0/spare0", "node0")


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield server


def _client(server) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))


def _in_threads(server, jobs: dict) -> dict:
    """Run ``fn(MembershipRound)`` for each name in its own thread with its own store client."""
    out, errors = {}, []

    def run(name, fn):
        try:
            out[name] = fn(MembershipRound(_client(server), epoch=1))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=item) for item in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return out


def _survivor(me: Member, deadline_s: float = 20.0):
    def fn(rnd):
        if rnd.join(me, survivor=True):
            rnd.decide((2, 1, 2), WORLD, deadline_s=deadline_s, shrink=True)
        return rnd.outcome(timeout_s=30)
    return fn


def _spare(me: Member, server):
    """An idle spare: it joined the next round long before the failure (Membership.await_rank), so it has
    joined before any survivor does; its thread reads the outcome."""
    MembershipRound(_client(server), epoch=1).join(me, survivor=False)
    return lambda rnd: rnd.outcome(timeout_s=30)


def test_survivors_and_a_spare_agree_on_one_world_as_soon_as_the_dead_is_reported(store):
    MembershipRound(_client(store), epoch=1).report_dead(WORLD[1].id)
    started = time.monotonic()
    jobs = {m.id: _survivor(m) for r, m in enumerate(WORLD) if r != 1}
    out = _in_threads(store, {**jobs, SPARE.id: _spare(SPARE, store)})
    assert time.monotonic() - started < 5  # no deadline waited out
    decisions = {o.assignment for o in out.values()}
    assert len(decisions) == 1
    (a,) = decisions
    assert a.holders == ("node0/0", "node0/spare0", "node1/0", "node1/1")
    assert out[SPARE.id].role(SPARE.id, spare=True) == "rank" and a.rank_of(SPARE.id) == 1


def test_a_hung_member_is_left_behind_at_the_deadline_and_a_late_survivor_must_leave(store):
    jobs = {m.id: _survivor(m, deadline_s=1.0) for r, m in enumerate(WORLD) if r != 3}
    started = time.monotonic()
    out = _in_threads(store, jobs)
    assert 1.0 <= time.monotonic() - started < 10
    (a,) = {o.assignment for o in out.values()}
    assert (a.dp, a.holders, a.idle) == (1, ("node0/0", "node0/1"), ("node1/0",))  # dp shrank to the whole replica
    late = MembershipRound(_client(store), epoch=1)
    assert not late.join(WORLD[3], survivor=True)  # not the first survivor: it does not decide
    outcome = late.outcome(timeout_s=1)
    assert outcome.assignment == a and outcome.role(WORLD[3].id) == "leave"
    assert outcome.role("node5/spare0", spare=True) == "idle"  # a spare not listed stays a spare


def test_a_round_that_cannot_complete_tells_everyone_to_leave(store):
    out = _in_threads(store, {WORLD[0].id: _survivor(WORLD[0], deadline_s=0.5)})
    assert out[WORLD[0].id].assignment is None and out[WORLD[0].id].role(WORLD[0].id) == "leave"


def test_each_epoch_forms_its_process_groups_under_its_own_keys(store):
    a, b = MembershipRound(_client(store), 1), MembershipRound(_client(store), 2)
    a.process_group_store().set("x", "1")
    assert not b.process_group_store().check(["x"]) and a.process_group_store().get("x") == b"1"


def test_a_decider_that_never_answers_ends_the_round_for_the_others(store):
    rnd = MembershipRound(_client(store), epoch=1)
    assert rnd.join(WORLD[0], survivor=True)  # the decider, which then dies before deciding
    other = MembershipRound(_client(store), epoch=1)
    assert not other.join(WORLD[1], survivor=True)
    started = time.monotonic()
    outcome = other.outcome(timeout_s=0.5)
    assert outcome.assignment is None and outcome.role(WORLD[1].id) == "leave" and time.monotonic() - started < 5


def test_a_decider_that_dies_before_it_answers_is_replaced_by_the_next_survivor(store):
    """A second failure in the round: the first survivor to join (the decider) dies before it publishes; the
    others see its death reported and one of them decides instead, giving both lost ranks to spares."""
    spares = [SPARE, Member("node1/spare0", "node1")]
    client = _client(store)
    for spare in spares:
        MembershipRound(client, epoch=1).join(spare, survivor=False)
    MembershipRound(client, epoch=1).report_dead(WORLD[1].id)  # the first failure
    assert MembershipRound(client, epoch=1).join(WORLD[0], survivor=True)  # the decider, which then dies
    MembershipRound(client, epoch=1).report_dead(WORLD[0].id)

    def survivor(me):
        def fn(rnd):
            deciding = rnd.join(me, survivor=True)
            decide = lambda: rnd.decide((2, 1, 2), WORLD, deadline_s=20.0, shrink=False)  # noqa: E731
            return deciding, rnd.await_outcome(me, WORLD, 30.0, decide)
        return fn

    started = time.monotonic()
    out = _in_threads(store, {m.id: survivor(m) for m in WORLD[2:]})
    assert time.monotonic() - started < 10 and not any(deciding for deciding, _ in out.values())
    (a,) = {o.assignment for _, o in out.values()}
    assert a.holders == ("node0/spare0", "node1/spare0", "node1/0", "node1/1")


def test_a_spare_that_died_with_its_node_is_not_given_a_rank(store):
    dead_spare = Member("node1/spare0", "node1")
    client = _client(store)
    MembershipRound(client, epoch=1).join(dead_spare, survivor=False)
    for member in (WORLD[3], dead_spare):  # the node's rank and its spare died together
        MembershipRound(client, epoch=1).report_dead(member.id)
    out = _in_threads(store, {**{m.id: _survivor(m) for m in WORLD[:3]}, SPARE.id: _spare(SPARE, store)})
    (a,) = {o.assignment for o in out.values()}
    assert a.holders[3] == SPARE.id and dead_spare.id not in a.idle


def test_without_a_spare_the_decider_waits_for_a_replacement_to_join(store):
    MembershipRound(_client(store), epoch=1).report_dead(WORLD[1].id)

    def survivor(me):
        def fn(rnd):  # whichever survivor joins first decides, and waits for the replacement
            if rnd.join(me, survivor=True):
                rnd.decide((2, 1, 2), WORLD, deadline_s=10, shrink=True, replacement_s=20)  # before shrinking
            return rnd.outcome(timeout_s=30)
        return fn

    def replacement(rnd):
        time.sleep(0.5)  # started after the failure, e.g. by a scheduler
        rnd.join(Member("node7/spare0", "node7"), survivor=False)
        return rnd.outcome(timeout_s=30)

    jobs = {**{m.id: survivor(m) for r, m in enumerate(WORLD) if r != 1}, "late": replacement}
    out = _in_threads(store, jobs)
    assert out["late"].assignment.holders[1] == "node7/spare0"
    assert len({o.assignment for o in out.values()}) == 1
    assert MembershipRound.decided_epochs(_client(store)) == 1


def test_with_no_replacement_in_time_the_decider_shrinks_to_a_trainable_dp(store):
    MembershipRound(_client(store), epoch=1).report_dead(WORLD[1].id)
    asked = []

    def survivor(me):
        def fn(rnd):
            if rnd.join(me, survivor=True):
                rnd.decide((2, 1, 2), WORLD, deadline_s=10, shrink=True, replacement_s=0.5,
                           dp_ok=lambda dp: asked.append(dp) or True)
            return rnd.outcome(timeout_s=30)
        return fn

    started = time.monotonic()
    out = _in_threads(store, {m.id: survivor(m) for r, m in enumerate(WORLD) if r != 1})
    assert time.monotonic() - started >= 0.5 and asked == [1]  # the wait came first, then one shrink
    (a,) = {o.assignment for o in out.values()}
    assert (a.dp, a.holders) == (1, ("node1/0", "node1/1"))
    assert out[WORLD[0].id].role(WORLD[0].id) == "idle"  # the broken replica's survivor: a spare now


def test_the_end_of_the_job_is_seen_by_idle_spares(store):
    client = _client(store)
    assert not MembershipRound.finished(client) and not MembershipRound(client, 1).decided()
    MembershipRound.finish(client)
    assert MembershipRound.finished(_client(store))


def test_a_spare_still_coming_up_is_waited_for_rather_than_shrinking(store):
    late = Member("node2/spare0", "node2")
    client = _client(store)
    MembershipRound(client, epoch=0).announce_spare(late.id)  # its agent started it; it is still importing
    MembershipRound(client, epoch=1).report_dead(WORLD[1].id)

    def coming_up(rnd):
        time.sleep(1.0)
        rnd.join(late, survivor=False)
        rnd.spare_up(late.id)
        return rnd.outcome(timeout_s=30)

    started = time.monotonic()
    out = _in_threads(store, {**{m.id: _survivor(m, deadline_s=10) for r, m in enumerate(WORLD) if r != 1},
                              late.id: coming_up})
    (a,) = {o.assignment for o in out.values()}
    assert a.dp == 2 and a.holders[1] == late.id  # no shrink: the spare took the lost rank
    assert time.monotonic() - started < 8


def test_a_spare_that_died_coming_up_is_not_waited_for(store):
    client = _client(store)
    for spare in ("node2/spare0", "node0/spare1"):
        MembershipRound(client, epoch=0).announce_spare(spare)
    MembershipRound(client, epoch=0).spare_up("node0/spare1")  # up, then gone: a holder of an earlier world
    for dead in (WORLD[1].id, "node2/spare0"):
        MembershipRound(client, epoch=1).report_dead(dead)
    started = time.monotonic()
    out = _in_threads(store, {m.id: _survivor(m, deadline_s=10) for r, m in enumerate(WORLD) if r != 1})
    (a,) = {o.assignment for o in out.values()}
    assert a.dp == 1 and time.monotonic() - started < 5  # shrunk at once: nobody is coming
