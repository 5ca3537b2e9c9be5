"""A membership round on the job's store: the processes still alive after a failure agree on the new world.

The store (a ``torch.distributed`` Store, e.g. a TCPStore) must outlive any one training process: the
launcher's agent hosts it, or a host the user names. Each round is an *epoch*; its keys live under
``<prefix>/<epoch>/`` and the process groups of the world it forms under ``<prefix>/<epoch>/pg/``
(:meth:`MembershipRound.process_group_store`), so a new epoch never meets an old one's keys.

    rnd = MembershipRound(store, epoch)
    if rnd.join(me, survivor=True):                    # every survivor and every idle spare (a Member)
        rnd.decide(degrees, world, deadline_s=..., shrink=...)    # the first survivor to join
    outcome = rnd.outcome(timeout_s)                   # everyone
    rank = outcome.assignment.rank_of(me.id)           # when outcome.role(me.id) == "rank"

The first survivor to join decides: it waits until every member of the failed world has joined or been
reported dead (:meth:`~MembershipRound.report_dead`: the launcher saw its process exit), or until the deadline
(a hung process never joins), then publishes :func:`~megatier.parallel.assignment.assign_ranks`' answer. A
lost rank with no spare in the round waits for a spare the launcher started that is still coming up
(:meth:`~MembershipRound.announce_spare`, :meth:`~MembershipRound.spare_up`: on a loaded machine importing torch
can outlast the first steps), up to the round's timeout, before the round shrinks dp.
Everyone reads that one answer, so no two processes act on different worlds; only the decider polls the
store (two counters), and only it reads the member list, once. A survivor that joins after the decision is
in neither list and must leave (:meth:`Outcome.role`), as must everyone when the round could not complete
(the job then falls back to a relaunch). A decider that dies before it publishes (a second failure in the
round) is replaced: its deputy, the second survivor to join, watches for its death and decides instead
(:meth:`MembershipRound.await_outcome`); the other survivors block on the store as before.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Optional

import torch.distributed as dist

from megatier.parallel.assignment import Assignment, Member, assign_ranks

PREFIX = "megatier/membership"
_POLL_S = 0.005
_LEASE_POLL_S = 0.25  # how often the decider reads the agents' heartbeats (one request per node)
BEAT_S = 0.5  # how often a node agent beats (megatier.launcher.agent)


def member_of_id(member_id: str) -> Member:
    """The member of a lifelong id ``<node>/<local>`` or ``<node>/spare<k>``."""
    return Member(member_id, member_id.rpartition("/")[0])


def beat(store: dist.Store, prefix: str, node: str) -> None:
    """Node ``node``'s agent is alive: one more beat on its counter."""
    store.add(f"{prefix}/beat/{node}", 1)


class NodeLeases:
    """The node agents' leases, as one decider sees them: a node whose beat counter stood still for ``lease_s``
    is lost, with every process on it. A node without a counter (no agent beats for it: processes started by
    another launcher) is never judged lost this way; its processes' deaths come from their reports or the
    round's deadline."""

    def __init__(self, store: dist.Store, prefix: str, lease_s: float):
        self.store, self.prefix, self.lease_s = store, prefix, lease_s
        self._seen: dict[str, tuple[int, float]] = {}  # node -> (its count, since when)

    def expired(self, nodes: set[str]) -> set[str]:
        now, out = time.monotonic(), set()
        for node in sorted(nodes):
            count = self.store.add(f"{self.prefix}/beat/{node}", 0)
            last = self._seen.get(node)
            if last is None or last[0] != count:
                self._seen[node] = (count, now)
            elif count and now - last[1] >= self.lease_s:
                out.add(node)
        return out


@dataclass(frozen=True)
class Outcome:
    """A round's published decision: the assignment, or None when the round could not complete (``reason``
    says why); ``step``, the newest step a survivor had trained, and ``still``, how many rounds in a row
    formed the same world without a step beyond that (a failure no loss explains: see :meth:`decide`)."""

    assignment: Optional[Assignment]
    reason: str = ""
    step: int = -1
    still: int = 0

    def to_json(self) -> str:
        a = self.assignment
        return json.dumps({"assignment": None if a is None else a.to_dict(), "reason": self.reason,
                           "step": self.step, "still": self.still})

    @classmethod
    def from_json(cls, doc: str) -> "Outcome":
        d = json.loads(doc)
        a = d["assignment"]
        return cls(None if a is None else Assignment.from_dict(a), d["reason"], d["step"], d["still"])

    def role(self, member_id: str, *, spare: bool = False) -> str:
        """``rank`` (take ``assignment.rank_of(member_id)``), ``idle`` (wait for a later round) or ``leave``. A
        spare the decision did not list (it joined late) stays a spare; a survivor it did not list leaves."""
        a = self.assignment
        if a is None:
            return "leave"
        if a.rank_of(member_id) is not None:
            return "rank"
        return "idle" if spare or member_id in a.idle else "leave"


class MembershipRound:
    """One epoch's round on ``store`` (see the module docstring)."""

    def __init__(self, store: dist.Store, epoch: int, prefix: str = PREFIX):
        self.store, self.epoch = store, epoch
        self.key = f"{prefix}/{epoch}"
        self._root = prefix
        self._dead = f"{prefix}/dead"
        self.survivor_index = 0  # this process's place among the survivors that joined (join): 1 decides

    # ---- members ------------------------------------------------------------------------------

    def join(self, member: Member, *, survivor: bool, step: int = -1) -> bool:
        """Enter the round, as a surviving rank's holder (``step``: the newest step it trained) or an idle spare;
        True for the one survivor that decides (the first to join: one process polls the store, the others
        wait for its answer; the second is its deputy, :meth:`await_outcome`)."""
        slot = self.store.add(f"{self.key}/joined", 1) - 1
        self.store.set(f"{self.key}/member/{slot}", json.dumps({"id": member.id, "node": member.node, "step": step}))
        self.survivor_index = self.store.add(f"{self.key}/survivors", 1) if survivor else 0
        if self.survivor_index == 1:
            self.store.set(f"{self.key}/decider", member.id)
        return self.survivor_index == 1

    def publish_holder(self, rank: int, member_id: str) -> None:
        """A launcher names rank ``rank``'s first holder before it starts it: a rank lost before the launch's
        first world forms is then known, and a round can replace it (epoch 0 has no decision that lists it)."""
        self.store.set(f"{self._root}/holder/{rank}", member_id)

    def launch_holders(self, world_size: int) -> Optional[list[str]]:
        """The first holders of ranks 0 .. ``world_size``-1 as the launcher named them, or None when it named
        not every one (a launcher without agents)."""
        keys = [f"{self._root}/holder/{r}" for r in range(world_size)]
        if not self.store.check(keys):
            return None
        return [self.store.get(k).decode() for k in keys]

    def announce_spare(self, member_id: str) -> None:
        """A launcher started spare ``member_id``: until it is up (:meth:`spare_up`) or dead, a round that has no
        spare for a lost rank waits for it rather than shrink."""
        slot = self.store.add(f"{self._root}/spares/count", 1) - 1
        self.store.set(f"{self._root}/spares/{slot}", member_id)

    def spare_up(self, member_id: str) -> None:
        """Spare ``member_id`` has joined its first round: it is in every round from now on (or holds a rank)."""
        slot = self.store.add(f"{self._root}/spares_up/count", 1) - 1
        self.store.set(f"{self._root}/spares_up/{slot}", member_id)

    def _spares_coming(self, world: list[Member], leases: "NodeLeases") -> bool:
        """Whether a spare a launcher started is neither up, nor in this round, nor dead: it is still starting."""
        started = set(self._listed(f"{self._root}/spares/count", f"{self._root}/spares"))
        if not started:
            return False
        up = set(self._listed(f"{self._root}/spares_up/count", f"{self._root}/spares_up"))
        coming = started - up - {m.id for m in self.members()}
        return bool(coming - self._lost_members([*world, *(member_of_id(i) for i in coming)], leases))

    def publish_world(self, ids: list[str]) -> None:
        """The launch's world (member id by rank), for the spares: epoch 0 has no decision that lists it."""
        self.store.set(f"{self._root}/world", json.dumps(ids))

    def world_lost(self, leases: "NodeLeases") -> bool:
        """Whether every holder of the job's current world is dead: no survivor is left to start a round, so a
        spare waiting for one would wait forever."""
        decided = self.decided_epochs(self.store, self._root)
        if decided:
            assignment = MembershipRound(self.store, decided, self._root).outcome(1.0).assignment
            holders = list(assignment.holders) if assignment is not None else []
        else:
            listed = self.store.check([f"{self._root}/world"])
            holders = json.loads(self.store.get(f"{self._root}/world")) if listed else []
        world = [member_of_id(h) for h in holders]
        return bool(world) and {m.id for m in world} <= self._lost_members(world, leases)

    def arrive(self) -> None:
        """A holder of the world this round formed is ready for its process groups."""
        self.store.add(f"{self.key}/arrived", 1)

    def arrived(self) -> int:
        return self.store.add(f"{self.key}/arrived", 0)

    def members(self) -> list[Member]:
        """Everyone who joined so far, in joining order."""
        return [Member(d["id"], d["node"]) for d in self._joined()]

    def _joined(self) -> list[dict]:
        return [json.loads(doc) for doc in self._listed(f"{self.key}/joined", f"{self.key}/member")]

    def _listed(self, count_key: str, item_prefix: str) -> list[str]:
        """The items appended under ``item_prefix`` (a count taken with ``add``, then the item written: one
        request waits for them all)."""
        keys = [f"{item_prefix}/{slot}" for slot in range(self.store.add(count_key, 0))]
        return [v.decode() for v in self.store.multi_get(keys)] if keys else []

    def report_dead(self, member_id: str) -> None:
        """The launcher saw member ``member_id``'s process exit: no round waits for it any more."""
        slot = self.store.add(f"{self._dead}/count", 1) - 1
        self.store.set(f"{self._dead}/{slot}", member_id)

    def reported_dead(self) -> set[str]:
        """The ids of the members the launcher reported dead so far (in any epoch)."""
        return set(self._listed(f"{self._dead}/count", self._dead))

    # ---- the decision -------------------------------------------------------------------------

    def decide(self, degrees: tuple[int, int, int], world: list[Member], *, deadline_s: float,
               shrink: bool, replacement_s: float = 0.0, dp_ok: Callable[[int], bool] = lambda dp: True,
               lease_s: float = 5.0) -> Outcome:
        """The deciding survivor's part: wait until every member of the failed ``world`` (by rank) has joined or
        is dead (reported by its agent, or on a node whose agent's lease of ``lease_s`` ran out), or for the
        deadline (a hung process never joins); publish the decision. With a lost rank and no spare for it, wait
        up to ``replacement_s`` more for one to join (a replacement process), and up to ``deadline_s`` more while
        a spare the launcher started is still coming up, then shrink dp if ``shrink`` (to a count of replicas
        ``dp_ok`` accepts). A round that would form the same world as the one before it,
        at the same step, twice in a row is refused: the failure recurs with nobody lost, so it is the job's
        own and another round would only repeat it."""
        deadline = time.monotonic() + deadline_s
        leases = NodeLeases(self.store, self._root, lease_s)
        gone, looked = 0, 0.0
        while time.monotonic() < deadline:
            if time.monotonic() - looked > _LEASE_POLL_S:
                gone, looked = self._gone_without_joining(world, leases), time.monotonic()
            if self.store.add(f"{self.key}/survivors", 0) + gone >= len(world):
                break
            time.sleep(_POLL_S)
        assignment = self._assign(degrees, world, leases)
        wait_until, spares_until = time.monotonic() + replacement_s, time.monotonic() + deadline_s
        while assignment is None and (time.monotonic() < wait_until or (
                time.monotonic() < spares_until and self._spares_coming(world, leases))):
            time.sleep(50 * _POLL_S)
            assignment = self._assign(degrees, world, leases)
        if assignment is None and shrink:
            assignment = self._assign(degrees, world, leases, True, dp_ok)
        outcome = self._judged(assignment, world)
        self.store.set(f"{self.key}/decision", outcome.to_json())
        self.store.add(f"{self._root}/decided", 1)
        return outcome

    def _judged(self, assignment: Optional[Assignment], world: list[Member]) -> Outcome:
        """The decision to publish: ``assignment`` with this round's step and streak, or why there is none."""
        if assignment is None:
            return Outcome(None, "no spare took a lost rank within recovery.wait_for_replacement_s, and dp could "
                                 "not shrink (recovery.shrink=false, or no whole data-parallel replica was left)")
        step = max((d.get("step", -1) for d in self._joined()), default=-1)
        before = MembershipRound(self.store, self.epoch - 1, self._root).outcome(1.0) if self.epoch > 1 else None
        progressed = before is None or step > before.step
        still = 0 if list(assignment.holders) != [m.id for m in world] else \
            (0 if progressed else before.still) + 1
        if still >= 2:
            return Outcome(None, f"the failure came back at step {step + 1} with every process alive, so it is "
                                 f"the job's own, not a lost peer's", step, still)
        return Outcome(assignment, "", max(step, before.step if before else -1), still)

    def _gone_without_joining(self, world: list[Member], leases: "NodeLeases") -> int:
        """How many members of ``world`` are dead and never joined (one that joined and then died, a decider
        replaced, is counted among the survivors already); the member list is read only when one is dead."""
        dead = self._lost_members(world, leases) & {m.id for m in world}
        return len(dead - {m.id for m in self.members()}) if dead else 0

    def await_outcome(self, me: Member, world: list[Member], timeout_s: float, decide: Callable[[], object],
                      lease_s: float = 5.0) -> "Outcome":
        """A survivor's wait for the round's decision (after :meth:`join`), up to ``timeout_s`` after the newest
        decider took the round. The decider's deputy (the second survivor to join) watches it meanwhile: should
        it die first (reported by its agent, or its node's lease run out), the deputy claims its place and runs
        ``decide`` (:meth:`decide` with the round's arguments) itself. The other survivors block on the store
        until the decision comes (twice as long: a deputy's decision comes after the decider's death), so the
        store serves one poller, not every survivor."""
        if self.survivor_index != 2:
            return self.outcome(2 * timeout_s)
        key, leases = f"{self.key}/decision", NodeLeases(self.store, self._root, lease_s)
        decider, deadline, looked = None, 0.0, 0.0
        while True:
            if self.store.check([key]):  # polled: a store wait that times out logs a warning each time
                return Outcome.from_json(self.store.get(key).decode())
            if time.monotonic() - looked < _LEASE_POLL_S:
                time.sleep(_POLL_S * 4)
                continue
            looked = time.monotonic()
            current = self.store.get(f"{self.key}/decider").decode()
            if current != decider:
                decider, deadline = current, time.monotonic() + timeout_s
            if time.monotonic() > deadline:
                return Outcome(None, f"no decision within {timeout_s:g} s: the deciding survivor hung")
            if decider in self._lost_members(world, leases) and self._claim(decider, me.id):
                decide()

    def _claim(self, dead: str, me: str) -> bool:
        """Take the dead decider's place; False when it was taken first (a deputy whose own outcome wait ended
        and who joined a later round has no rival here, but the claim keeps one decider per round anyway)."""
        return self.store.compare_set(f"{self.key}/decider", dead, me).decode() == me

    def _lost_members(self, world: list[Member], leases: "NodeLeases") -> set[str]:
        """The members known dead: reported by their agent, or on a node whose agent's lease ran out (a lost
        machine takes its spares too, even one that joined this round before it died)."""
        members = [*world, *self.members()]
        lost = leases.expired({m.node for m in members})
        return self.reported_dead() | {m.id for m in members if m.node in lost}

    def _assign(self, degrees: tuple[int, int, int], world: list[Member], leases: "NodeLeases",
                shrink: bool = False, dp_ok: Callable[[int], bool] = lambda dp: True) -> Optional[Assignment]:
        dead = self._lost_members(world, leases)  # a spare that died with its node had joined, but cannot take a rank
        joined = [m for m in self.members() if m.id not in dead]
        return assign_ranks(degrees, world, joined, shrink=shrink, dp_ok=dp_ok)

    def decided(self) -> bool:
        """Whether this round's decision is published (a spare polls this, without blocking)."""
        return self.store.check([f"{self.key}/decision"])

    def outcome(self, timeout_s: float) -> Outcome:
        """The published decision, waited for up to ``timeout_s``; none by then (the decider died or hung: a
        second failure during the recovery) is a round that could not complete."""
        key = f"{self.key}/decision"
        try:
            self.store.wait([key], timedelta(seconds=timeout_s))
        except dist.DistStoreError:
            return Outcome(None, f"no decision within {timeout_s:g} s: the deciding survivor died or hung")
        return Outcome.from_json(self.store.get(key).decode())

    @staticmethod
    def decided_epochs(store: dist.Store, prefix: str = PREFIX) -> int:
        """How many rounds have published a decision: a process that starts later (a replacement's spare) joins
        the round after them (rounds are numbered 1, 2, ... as failures happen; epoch 0 is the launch)."""
        return store.add(f"{prefix}/decided", 0)

    @staticmethod
    def finish(store: dist.Store, prefix: str = PREFIX) -> None:
        """The job has ended (its last rank 0 closed): idle spares stop waiting."""
        store.set(f"{prefix}/finished", "1")

    @staticmethod
    def finished(store: dist.Store, prefix: str = PREFIX) -> bool:
        return store.check([f"{prefix}/finished"])

    def process_group_store(self) -> dist.Store:
        """Where the new world's process groups rendezvous: this epoch's own part of the store."""
        return dist.PrefixStore(f"{self.key}/pg/", self.store)
