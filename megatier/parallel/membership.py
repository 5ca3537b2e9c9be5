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
(a hung process never joins), then publishes :func:`~megatier.parallel.assignment.assign_ranks`' answer.
Everyone reads that one answer, so no two processes act on different worlds; only the decider polls the
store (two counters), and only it reads the member list, once. A survivor that joins after the decision is
in neither list and must leave (:meth:`Outcome.role`), as must everyone when the round could not complete
(the job then falls back to a relaunch).
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


@dataclass(frozen=True)
class Outcome:
    """A round's published decision: the assignment, or None when the round could not complete."""

    assignment: Optional[Assignment]

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

    # ---- members ------------------------------------------------------------------------------

    def join(self, member: Member, *, survivor: bool) -> bool:
        """Enter the round, as a surviving rank's holder or an idle spare; True for the one survivor that
        decides (the first to join: one process polls the store, the others wait for its answer)."""
        slot = self.store.add(f"{self.key}/joined", 1) - 1
        self.store.set(f"{self.key}/member/{slot}", json.dumps({"id": member.id, "node": member.node}))
        return survivor and self.store.add(f"{self.key}/survivors", 1) == 1

    def members(self) -> list[Member]:
        """Everyone who joined so far, in joining order."""
        return [Member(**json.loads(doc)) for doc in self._listed(f"{self.key}/joined", f"{self.key}/member")]

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
               shrink: bool, replacement_s: float = 0.0, dp_ok: Callable[[int], bool] = lambda dp: True) -> Outcome:
        """The deciding survivor's part: wait until every member of the failed ``world`` (by rank) has joined or
        been reported dead, or for the deadline (a hung process never joins); publish the decision. With a lost
        rank and no spare for it, wait up to ``replacement_s`` more for one to join (a replacement process), then
        shrink dp if ``shrink`` (to a count of replicas ``dp_ok`` accepts)."""
        deadline = time.monotonic() + deadline_s
        ids = {m.id for m in world}
        while time.monotonic() < deadline:
            joined = self.store.add(f"{self.key}/survivors", 0)
            if joined + len(self.reported_dead() & ids) >= len(world):
                break
            time.sleep(_POLL_S)
        assignment = self._assign(degrees, world)
        wait_until = time.monotonic() + replacement_s
        while assignment is None and time.monotonic() < wait_until:
            time.sleep(50 * _POLL_S)
            assignment = self._assign(degrees, world)
        if assignment is None and shrink:
            assignment = self._assign(degrees, world, True, dp_ok)
        self.store.set(f"{self.key}/decision", json.dumps(None if assignment is None else assignment.to_dict()))
        self.store.add(f"{self._root}/decided", 1)
        return Outcome(assignment)

    def _assign(self, degrees: tuple[int, int, int], world: list[Member], shrink: bool = False,
                dp_ok: Callable[[int], bool] = lambda dp: True) -> Optional[Assignment]:
        dead = self.reported_dead()  # a spare that died with its node had joined, but cannot take a rank
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
            return Outcome(None)
        doc = json.loads(self.store.get(key))
        return Outcome(None if doc is None else Assignment.from_dict(doc))

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
