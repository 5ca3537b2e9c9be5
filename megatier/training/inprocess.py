"""In-process recovery: the processes that survive a failure re-form the job with hot spares and restore in place.

With ``recovery.mode=inprocess`` and a membership store (``recovery.store``, or the one ``megatier-agent``
names in MEGATIER_MEMBERSHIP_STORE), every process of a launch has a lifelong member id (MEGATIER_MEMBER_ID,
``<node>/<slot>``; a hot spare's ``<node>/spare<k>``). When a peer dies, its collectives fail on every surviving
rank (gloo: the connection closes, or the collective times out for a hung peer). Each survivor then

1. stops its checkpoint threads without a collective (node memory keeps what they stored),
2. tears down its process groups and joins the next membership round
   (:mod:`megatier.parallel.membership`): survivors keep their ranks, a spare takes each lost one,
3. rendezvouses the new world's groups under the round's part of the store and points its model, optimizer
   and gradient buffer at them (:func:`~megatier.parallel.state.swap_groups`): nothing is rebuilt,
4. builds a new checkpointer and restores as a relaunch would, except that a rank whose memory is already at
   the agreed end reads nothing (``ShardAccess.live_version``).

A spare started with MEGATIER_SPARE=1 has imported everything and waits in the rounds (:meth:`Membership.
await_rank`) until one gives it a rank; it then builds its Trainer on the round's groups and restores the lost
rank's state from its node's memory (a process crash) or its ring peer's (a lost node).

With no spare for a lost rank within ``recovery.wait_for_replacement_s``, the round drops the data-parallel
replicas the loss broke (``recovery.shrink``, the default); their surviving processes wait like spares
(:class:`JobEnded` when the job ends first). A round that cannot complete (no spare and no shrinking, the store
gone, a decider that died) ends the launch with :class:`RoundFailed`: the next launch restores exactly as after
any failure.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import setproctitle
import torch.distributed as dist

from megatier.config import Config, ConfigError, RecoveryConfig, validate
from megatier.faults import CrashPoint, FaultInjector
from megatier.launcher.agent import ENV_MEMBER, ENV_RUN, ENV_SPARE, ENV_STORE, connect_store, run_prefix
from megatier.parallel.assignment import Assignment, Member
from megatier.parallel.membership import MembershipRound, NodeLeases, member_of_id

log = logging.getLogger(__name__)

_SPARE_POLL_S = 0.02
_DEAD_POLL_S = 0.2


class RoundFailed(RuntimeError):
    """The membership round could not re-form the job; the launch ends and a relaunch restores. ``announce``:
    whether this process says so (:meth:`Membership.failed`: one process of the launch, whatever its rank, as
    rank 0 may be among the lost); None leaves it to global rank 0."""

    def __init__(self, message: str, announce: Optional[bool] = None):
        super().__init__(message)
        self.announce = announce


class PeerLost(RuntimeError):
    """A holder of the world a round just formed died (or never came) before that world's groups formed:
    another round recovers it."""


class JobEnded(Exception):
    """A survivor whose replica a shrink dropped waited as a spare, and the job ended without it: exit 0."""


def member_of(member_id: str) -> Member:
    """The member whose id is ``<node>/<slot>``."""
    node, _, slot = member_id.rpartition("/")
    if not node or not slot:
        raise ValueError(f"{ENV_MEMBER}={member_id!r} must be <node>/<slot>")
    return member_of_id(member_id)


def is_spare() -> bool:
    return os.environ.get(ENV_SPARE) == "1"


def store_address(cfg: RecoveryConfig) -> Optional[str]:
    """Where the membership store is, or None when this launch recovers by relaunch."""
    if cfg.mode != "inprocess":
        return None
    return cfg.store or os.environ.get(ENV_STORE) or None


@dataclass
class Membership:
    """This process's place in the job's membership rounds: the store, its id, the epoch (rounds so far) and
    the holders of the current world's ranks."""

    store: dist.Store
    me: Member
    prefix: str
    cfg: RecoveryConfig
    epoch: int = 0
    world: list[Member] = field(default_factory=list)
    assigned_at: Optional[float] = None  # a spare's: when a round gave it a rank (its recovery's detection)
    assignment: Optional[Assignment] = None  # the last round's, once this process adopted it

    @classmethod
    def connect(cls, cfg: RecoveryConfig, timeout_s: float) -> Optional["Membership"]:
        """The membership of this process, or None when it recovers by relaunch (no store known, no member id:
        a launcher that restarts every process anyway)."""
        address, member_id = store_address(cfg), os.environ.get(ENV_MEMBER)
        if address is None or member_id is None:
            return None
        store = connect_store(address, timeout_s)
        return cls(store, member_of(member_id), run_prefix(os.environ.get(ENV_RUN, "job")), cfg)

    def process_group_store(self) -> dist.Store:
        """Where this epoch's process groups rendezvous."""
        return MembershipRound(self.store, self.epoch, self.prefix).process_group_store()

    def learn_world(self, group: dist.ProcessGroup) -> None:
        """Epoch 0: every rank tells every other its member id (one all-gather over ``group``)."""
        ids: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(ids, self.me.id, group=group)
        self.world = [member_of(i) for i in ids]
        if dist.get_rank(group) == 0:
            MembershipRound(self.store, 0, self.prefix).publish_world(ids)

    # ---- survivors -----------------------------------------------------------------------------

    def survive(self, degrees: tuple[int, int, int], dp_ok: Callable[[int], bool], step: int = -1) -> Optional[int]:
        """Join the next round as a survivor that trained up to ``step``; the rank this process holds in the
        re-formed world (its own when the layout stays), or None when the round dropped its data-parallel
        replica (it is idle: a spare now). RoundFailed when the round could not complete or left this process
        out. ``dp_ok``: whether the job can train with that many replicas (``recovery.shrink``)."""
        self.epoch += 1
        rnd = MembershipRound(self.store, self.epoch, self.prefix)
        cfg = self.cfg
        wait = 2 * cfg.round_timeout_s + cfg.wait_for_replacement_s + cfg.node_lease_s  # decide()'s bound
        def decide():
            return rnd.decide(degrees, self.world, deadline_s=cfg.round_timeout_s, shrink=cfg.shrink,
                              replacement_s=cfg.wait_for_replacement_s, dp_ok=dp_ok, lease_s=cfg.node_lease_s)

        try:
            if rnd.join(self.me, survivor=True, step=step):
                decide()
            outcome = rnd.await_outcome(self.me, self.world, wait + 10.0, decide, lease_s=cfg.node_lease_s)
        except (RuntimeError, dist.DistError) as e:  # the store is gone: nothing to re-form on
            raise RoundFailed(f"the membership store is unreachable ({e})") from None
        role = outcome.role(self.me.id)
        if role == "idle":
            return None
        if role != "rank" and outcome.assignment is None:
            raise self.failed(outcome.reason)
        if role != "rank":  # the job goes on without this process (it came late): nothing to announce
            raise RoundFailed("this process was left out of the re-formed job", announce=False)
        return self._adopt(outcome.assignment)

    def failed(self, reason: str) -> RoundFailed:
        """The launch's end for ``reason``, said by the first of its processes to get here."""
        try:
            first = self.store.add(f"{self.prefix}/failure_said", 1) == 1
        except (RuntimeError, dist.DistError):
            first = None
        return RoundFailed(reason, announce=first)

    def rendezvous(self, rank: int, timeout_s: float) -> None:
        """Wait until every holder of the world this epoch formed has arrived, before its process groups form:
        torch's own rendezvous would wait its whole timeout for a holder that died after the decision. Raises
        PeerLost at once when one is reported dead, or after ``timeout_s`` (a hung holder)."""
        rnd = MembershipRound(self.store, self.epoch, self.prefix)
        rnd.arrive()
        ids, nodes = {m.id for m in self.world}, {m.node for m in self.world}
        leases = NodeLeases(self.store, self.prefix, self.cfg.node_lease_s)
        deadline, looked = time.monotonic() + timeout_s, 0.0
        while rnd.arrived() < len(self.world):
            if time.monotonic() - looked > _DEAD_POLL_S:
                lost, looked = sorted(rnd.reported_dead() & ids) + sorted(leases.expired(nodes)), time.monotonic()
                if lost:
                    raise PeerLost(f"{', '.join(lost)} died before the world of round {self.epoch} formed")
            if time.monotonic() > deadline:
                raise PeerLost(f"a holder of round {self.epoch}'s world did not come within {timeout_s:g} s")
            time.sleep(_SPARE_POLL_S)

    def _adopt(self, assignment) -> int:
        self.assignment = assignment
        self.world = [member_of(h) for h in assignment.holders]
        return assignment.rank_of(self.me.id)

    # ---- spares --------------------------------------------------------------------------------

    def await_rank(self) -> Optional[int]:
        """A spare's wait: join each round until one gives this process a rank (returned), or the job ends
        (None: the launch finished, or a round failed and the launch is ending). RoundFailed when every rank
        of the job died at once: no survivor is left to start a round."""
        self.epoch = MembershipRound.decided_epochs(self.store, self.prefix) + 1
        leases, looked = NodeLeases(self.store, self.prefix, self.cfg.node_lease_s), time.monotonic()
        up = False
        while True:
            rnd = MembershipRound(self.store, self.epoch, self.prefix)
            rnd.join(self.me, survivor=False)
            if not up:  # in a round now: a round short of a spare no longer waits for this one to come up
                rnd.spare_up(self.me.id)
                up = True
            while not rnd.decided():
                if MembershipRound.finished(self.store, self.prefix):
                    return None
                if time.monotonic() - looked > _DEAD_POLL_S:
                    looked = time.monotonic()
                    if rnd.world_lost(leases):  # the launch is over: the other spares and the agents stop waiting
                        MembershipRound.finish(self.store, self.prefix)
                        raise self.failed("every rank of the job was lost at once, so no survivor is left to "
                                          "re-form it")
                time.sleep(_SPARE_POLL_S)
            outcome = rnd.outcome(timeout_s=1.0)
            role = outcome.role(self.me.id, spare=True)
            if role == "rank":
                self.assigned_at = time.time()
                return self._adopt(outcome.assignment)
            if role == "leave":
                return None
            self.epoch += 1

    def finish(self) -> None:
        """The job ended: idle spares stop waiting."""
        try:
            MembershipRound.finish(self.store, self.prefix)
        except (RuntimeError, dist.DistError) as e:
            log.warning("could not tell the idle spares that the job ended: %s", e)


def name_process(rank: Optional[int] = None) -> None:
    """Title this process for ``ps`` and ``top``: ``megatier <member id> rank <r>``, or ``spare`` while it waits
    (``megatier rank <r>`` under a launcher that gives no member id), so a user can tell the processes apart."""
    rank = rank if rank is not None else (int(os.environ["RANK"]) if "RANK" in os.environ and not is_spare()
                                          else None)
    who = os.environ.get(ENV_MEMBER)
    role = "spare" if rank is None else f"rank {rank}"
    setproctitle.setproctitle(f"megatier {who} {role}" if who else f"megatier {role}")


def become_rank(membership: Membership, rank: int) -> None:
    """The environment of a process that now holds ``rank`` of the current world. Its local rank is its place
    among its node's ranks, so a spare takes the lost rank's ring position (same local rank, its ring peer)."""
    world = membership.world
    name_process(rank)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(len(world))
    os.environ["LOCAL_RANK"] = str([r for r, m in enumerate(world) if m.node == world[rank].node].index(rank))


def trainable_dp(cfg: Config, dp: int) -> bool:
    """Whether the job of ``cfg`` trains with ``dp`` data-parallel replicas (a shrink's choice)."""
    try:
        validate(cfg, dp * cfg.parallel.tp * cfg.parallel.pp)
    except ConfigError:
        return False
    return True


def wait_if_spare(cfg: Config) -> tuple[bool, Optional[Membership]]:
    """For a hot spare (MEGATIER_SPARE=1): wait for a rank and for the other holders of its world; (False,
    None) when the job ended without needing it. Any other process: (True, None) at once. A holder lost before
    that world formed sends the spare, now holding a rank, into the next round as a survivor."""
    if not is_spare():
        return True, None
    membership = Membership.connect(cfg.recovery, cfg.parallel.timeout_s)
    if membership is None:
        raise RoundFailed(f"{ENV_SPARE}=1 needs recovery.mode=inprocess, a membership store and {ENV_MEMBER}")
    if _hold(membership, membership.await_rank(), cfg):
        return True, membership
    return False, None


def _hold(membership: Membership, rank: Optional[int], cfg: Config) -> bool:
    """Take ``rank`` of the round just decided and wait for the other holders of its world; while one is lost
    before that world forms, join the next round as a survivor (a dropped replica waits as a spare). False when
    the job ended without needing this process."""
    while rank is not None:
        become_rank(membership, rank)
        log.info("%s takes rank %d (round %d)", membership.me.id, rank, membership.epoch)
        try:
            membership.rendezvous(rank, cfg.parallel.timeout_s)
            return True
        except PeerLost as e:
            log.info("%s: %s; joining the next round", membership.me.id, e)
            a = membership.assignment
            rank = membership.survive((a.tp, a.pp, a.dp), lambda dp: trainable_dp(cfg, dp))
            rank = membership.await_rank() if rank is None else rank
    return False


def join_first_world(membership: Optional[Membership], cfg: Config) -> None:
    """A launch's first world: wait for every rank its launcher named before torch's rendezvous, which would
    wait its whole timeout for a rank that died on the way (importing, composing its config). A rank reported
    dead sends the others into a round, as after any failure: a spare takes it, or the job shrinks. Nothing to
    do for a spare (its round's world is formed) or under a launcher that names no holders (torch's rendezvous,
    then :meth:`Membership.learn_world`). JobEnded when the round dropped this process's replica for good."""
    if membership is None or membership.world:
        return
    size, first = int(os.environ["WORLD_SIZE"]), MembershipRound(membership.store, 0, membership.prefix)
    holders = first.launch_holders(size)
    if holders is None:
        return
    membership.world = [member_of(h) for h in holders]
    FaultInjector.from_env(int(os.environ["RANK"])).hit(CrashPoint.LAUNCH_FIRST_WORLD, 0)
    try:
        membership.rendezvous(int(os.environ["RANK"]), cfg.parallel.timeout_s)
        if os.environ["RANK"] == "0":
            first.publish_world(holders)
        return
    except PeerLost as e:
        log.warning("%s; re-forming the job before its first step", e)
    p = cfg.parallel
    rank = membership.survive((p.tp, p.pp, size // (p.tp * p.pp)), lambda dp: trainable_dp(cfg, dp))
    if not _hold(membership, membership.await_rank() if rank is None else rank, cfg):
        raise JobEnded(f"member {membership.me.id} was not needed before the job ended")


def release_spares(trainer, cfg: Optional[RecoveryConfig]) -> None:
    """When a rank's process ends (the job finished, or failed in a way no round recovers): idle spares stop
    waiting. A process that dies without getting here (a crash) is what the rounds recover from."""
    membership = getattr(trainer, "membership", None)
    if membership is None and cfg is not None and not is_spare():
        try:
            membership = Membership.connect(cfg, timeout_s=10.0)
        except (RuntimeError, dist.DistError):
            return  # no store: no spare is waiting on it
    if membership is not None:
        membership.finish()
