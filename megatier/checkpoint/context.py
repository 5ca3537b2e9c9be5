"""CheckpointContext: everything the save and recovery paths share, built once per launch.

:func:`build_context` is collective (every rank calls it in the same order,
because it creates a process group and agrees on an incarnation token). After
that, the manager and recovery read the context; neither looks at the
trainer's config or at globals. Tests build a context directly, with
in-memory tiers and a :class:`~megatier.checkpoint.comm.SoloComm`.

Process groups (both gloo, both over every rank, both with the job's timeout):
  control group   main-thread checkpoint collectives: inventory and plan at
                  restore, the periodic watermark / recovery-point reduction
  transfer group  used by exactly one thread at a time: recovery's transfers
                  before the loop starts, then only the Tier-2 replicator's
                  background thread. Keeping it apart means a paced transfer
                  never interleaves with a main-thread collective.
"""
from __future__ import annotations

import logging
import secrets
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from megatier.checkpoint.comm import CheckpointComm, GroupComm
from megatier.checkpoint.commit.lease import LeaseHeld, OwnerLease
from megatier.checkpoint.policy.auto_interval import initial_interval
from megatier.checkpoint.storage.store import ObjectStore, RetryPolicy, StoreError, retry_call
from megatier.checkpoint.tiers.adoption import adopt_orphans
from megatier.checkpoint.tiers.base import Tier
from megatier.checkpoint.tiers.local import LocalTier
from megatier.checkpoint.tiers.node_memory import NodeMemory
from megatier.checkpoint.tiers.peer import PeerTier, ReplicaArea
from megatier.checkpoint.tiers.remote import RemoteTier, open_remote_store
from megatier.checkpoint.tiers.replicator import PeerReplicator
from megatier.config import CheckpointConfig, ConfigError, ReliabilityConfig
from megatier.config.fingerprint import fingerprint_hash
from megatier.faults import FaultHook, FaultInjector, no_faults
from megatier.parallel.layout import Layout

log = logging.getLogger(__name__)


@dataclass
class CheckpointContext:
    """The checkpoint system's view of this rank: its config, identity, node, tiers and collectives."""

    cfg: CheckpointConfig  # the run's effective config (what it wrote to config.yaml)
    layout: Layout
    node: str
    tiers: list[Tier]  # cheapest first: the order of the recovery cascade
    comm: CheckpointComm
    fault: FaultHook = no_faults
    timeout_s: float = 600.0
    fingerprint: dict = field(default_factory=dict)  # megatier.config.fingerprint.state_fingerprint of the run
    followed: tuple[str, ...] = ()  # fingerprint keys a restore takes from the job's record (followed_keys)
    # The restart-loop guard's window and limit, the replica check's interval (reliability.*; the rest of that
    # group is the training loop's).
    reliability: ReliabilityConfig = field(default_factory=ReliabilityConfig)
    fingerprint_id: str = field(init=False)
    job_id: str = field(init=False)
    rank: int = field(init=False)
    world_size: int = field(init=False)

    def __post_init__(self) -> None:
        self.job_id, self.rank, self.world_size = self.cfg.job_id, self.layout.rank, self.layout.world_size
        self.fingerprint_id = fingerprint_hash(self.fingerprint)

    def adopt(self, values: dict[str, str]) -> None:
        """Take the job's recorded values of followed keys into the run's fingerprint (after a restore)."""
        self.fingerprint.update(values)
        self.fingerprint_id = fingerprint_hash(self.fingerprint)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the tiers (their threads, the Tier-3 lease) of a context used without a manager (tools, tests)."""
        for tier in self.tiers:
            tier.close(timeout)


@dataclass(frozen=True)
class RemoteStart:
    """How Tier-3 starts for this launch: the incarnation token every rank shares, rank 0's lease, and why
    Tier-3 is offline (None: it answered and the lease is held)."""

    incarnation: str
    lease: Optional[OwnerLease] = None
    offline: Optional[str] = None


# Reaching Tier-3 at start-up: a few quick attempts, so a launch with node memory does not wait long for it.
START_RETRY = RetryPolicy(attempts=3, base_delay_s=0.5, max_delay_s=2.0)


def _start_remote(store: Optional[ObjectStore], cfg: CheckpointConfig, comm: CheckpointComm) -> RemoteStart:
    """Rank 0 checks Tier-3, takes the owner lease and mints the launch's incarnation token; every rank learns
    the token, or the one-line reason it cannot start. A Tier-3 that does not answer (a transient failure) with
    node memory configured starts the launch offline instead (:class:`~.tiers.remote.RemoteTier`)."""
    verdict: dict = {"refused": None, "lease_held": False, "incarnation": None, "offline": None}
    lease = None
    if comm.rank == 0:
        verdict["incarnation"] = f"{uuid.uuid4().hex[:12]}{secrets.token_hex(2)}"
        if store is not None:
            lease = OwnerLease(store.fail_fast(), verdict["incarnation"], cfg.remote.lease_s)
            try:
                retry_call(store.fail_fast().check, START_RETRY, "reaching it")
                lease.acquire()
            except LeaseHeld as e:
                verdict.update(refused=str(e), lease_held=True)
            except StoreError as e:
                if e.transient and "local" in cfg.tiers:
                    verdict["offline"] = f"unreachable at start-up: {e}"
                else:
                    verdict["refused"] = f"checkpoint.remote.url={cfg.remote.url!r} is not usable: {e}"
            except Exception as e:  # any failure here must reach every rank, not only rank 0
                verdict["refused"] = f"checkpoint.remote.url={cfg.remote.url!r} is not usable: {e}"
    verdict = comm.gather(verdict, what="checkpoint start-up")[0]
    if verdict["refused"] is not None:
        raise (LeaseHeld if verdict["lease_held"] else ConfigError)(verdict["refused"])
    # An offline Tier-3 is reported by the restore's decision (consensus.fresh_without): only node memory can
    # tell whether this launch may start without it.
    return RemoteStart(verdict["incarnation"], lease, verdict["offline"])


def build_context(cfg: CheckpointConfig, ps, *, timeout_s: float, fault: Optional[FaultInjector] = None,
                  remote_store: Optional[ObjectStore] = None, fingerprint: Optional[dict] = None,
                  followed: tuple[str, ...] = (),
                  reliability: Optional[ReliabilityConfig] = None, reformed: bool = False) -> CheckpointContext:
    """Open the tiers of ``cfg`` (already validated and made effective for this topology) on every rank.

    ``ps`` is the job's ParallelState. Unreachable or unwritable tiers fail here,
    before any training work, on every rank. ``remote_store`` replaces the store
    that ``checkpoint.remote.url`` names (tests: a store that fails on purpose). ``reformed``: the world an
    in-process recovery re-formed, where a node area no rank is on now is this launch's, not worth a warning.
    """
    if "peer" in cfg.tiers and ps.num_nodes < 2:
        raise ValueError("checkpoint.tiers has peer on a one-node job; build the context from the effective "
                         "config (megatier.checkpoint.policy.rules.effective_checkpoint_config)")
    fault = fault if fault is not None else FaultInjector.from_env(ps.rank)
    transfer_group = dist.new_group(list(range(ps.world_size)), timeout=timedelta(seconds=timeout_s), backend="gloo")
    comm = GroupComm(ps.checkpoint_group, transfer_group, timeout_s)
    store = remote_store
    if "remote" in cfg.tiers and store is None:
        store = open_remote_store(cfg.remote.url, cfg.job_id, endpoint_url=cfg.remote.endpoint_url,
                                  fsync=cfg.remote.fsync)
    remote = _start_remote(store, cfg, comm)
    tiers: list[Tier] = []
    if "local" in cfg.tiers:
        lists = ps.local_rank == 0  # reclaims what ranks of an older layout or ring left on this node
        elsewhere = adopt_orphans(comm, cfg.local.root, cfg.job_id, ps.node_name, ps.node_names or (ps.node_name,),
                                  server=lists, announce=not reformed)
        memory = NodeMemory(cfg.local.root, cfg.job_id, ps.node_name, fault_hook=fault)
        tiers.append(LocalTier(memory, ps.rank, keep_bases=cfg.local.keep_bases,
                               budget_bytes=int(cfg.local.budget_gib * (1 << 30)), fault=fault,
                               world_size=ps.world_size if lists else None, other_names=elsewhere))
        if ps.replica_holder_rank is None or "peer" not in cfg.tiers:
            tiers.append(ReplicaArea(memory, lists=lists, fault=fault))  # what an earlier ring left here
        else:
            replicator = PeerReplicator(memory, rank=ps.rank, holder_rank=ps.replica_holder_rank,
                                        owner_rank=ps.replica_owner_rank, group=transfer_group,
                                        base_interval=initial_interval(cfg),
                                        max_chunk_bytes=int(cfg.peer.max_chunk_mib * (1 << 20)),
                                        timeout_s=timeout_s, fault_hook=fault)
            tiers.append(PeerTier(memory, replicator, keep_bases=cfg.local.keep_bases, fault=fault, lists=lists))
    if store is not None:
        tiers.append(RemoteTier(store, job_id=cfg.job_id, rank=ps.rank, world_size=ps.world_size,
                                incarnation=remote.incarnation, keep_bases=cfg.remote.keep_bases,
                                drain_timeout_s=cfg.remote.drain_timeout_s, lease=remote.lease, fault=fault,
                                offline=remote.offline))
    return CheckpointContext(cfg, ps.plain(), ps.node_name, tiers, comm, fault, timeout_s, dict(fingerprint or {}),
                             tuple(followed), reliability or ReliabilityConfig())
