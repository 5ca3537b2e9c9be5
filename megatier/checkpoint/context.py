"""CheckpointContext: everything the save and recovery paths share, built once per launch.

Built collectively (every rank calls :func:`build_context` in the same order,
because it creates a process group and agrees on an incarnation token). After
that, the manager, the Tier-2 replicator and recovery read it; none of them
looks at the trainer's config or globals.

Process groups (both gloo, both over every rank, both with the job's timeout):
  control_group   main-thread checkpoint collectives: inventory and plan at
                  restore, the periodic watermark / recovery-point reduction
  peer_group      used by exactly one thread at a time: recovery's Tier-2
                  transfers before the loop starts, then only the Tier-2
                  replicator's background thread. Keeping it apart means a
                  paced transfer never interleaves with a main-thread collective.
"""
from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from megatier.checkpoint.tiers.node_memory import LocalTier
from megatier.checkpoint.format.payload import ShardLayout
from megatier.checkpoint.tiers.remote import open_remote_store
from megatier.checkpoint.tiers.store import ObjectStore
from megatier.checkpoint.validation import validate_checkpoint_config
from megatier.config import CheckpointConfig
from megatier.faults import FaultInjector


@dataclass
class CheckpointContext:
    """The checkpoint system's view of this rank, its node, its ring peers and the tiers."""

    cfg: CheckpointConfig  # effective config: the peer tier is dropped on one node
    job_id: str
    layout: ShardLayout
    rank: int
    world_size: int
    node_name: str
    num_nodes: int
    local_rank: int
    # Tier-2 ring (None when the peer tier is off): we send our replica to the holder and keep the owner's.
    replica_holder_rank: Optional[int]
    replica_owner_rank: Optional[int]
    local: Optional[LocalTier]
    remote: Optional[ObjectStore]
    control_group: dist.ProcessGroup = field(repr=False)
    peer_group: dist.ProcessGroup = field(repr=False)
    incarnation: str
    fault: FaultInjector
    timeout_s: float

    def has(self, tier: str) -> bool:
        return tier in self.cfg.tiers

    @property
    def is_coordinator(self) -> bool:
        """Global rank 0 writes commit records and reclaims Tier-3."""
        return self.rank == 0


def build_context(cfg: CheckpointConfig, ps, *, timeout_s: float,
                  fault: Optional[FaultInjector] = None) -> CheckpointContext:
    """Validate ``cfg`` for this job, open the tiers, agree on an incarnation; collective over all ranks.

    ``ps`` is the job's ParallelState. Unreachable or unwritable tiers fail here,
    before any training work, on every rank (rank 0 checks Tier-3 and the
    verdict is broadcast so no rank is left waiting).
    """
    cfg = validate_checkpoint_config(cfg, ps.num_nodes)
    fault = fault if fault is not None else FaultInjector.from_env(ps.rank)
    timeout = timedelta(seconds=timeout_s)
    peer_group = dist.new_group(list(range(ps.world_size)), timeout=timeout, backend="gloo")
    control_group = ps.checkpoint_group
    local = LocalTier(cfg.local.root, cfg.job_id, ps.node_name, fault_hook=fault) if "local" in cfg.tiers else None
    remote = None
    if "remote" in cfg.tiers:
        remote = open_remote_store(cfg.remote.url, cfg.job_id, endpoint_url=cfg.remote.endpoint_url,
                                   fsync=cfg.remote.fsync)
    # Rank 0 checks Tier-3 and mints the incarnation; everyone learns both at once.
    verdict: list = [None, None]
    if ps.rank == 0:
        verdict[1] = f"{uuid.uuid4().hex[:12]}{secrets.token_hex(2)}"
        if remote is not None:
            try:
                remote.check()
            except Exception as e:  # any failure here must reach every rank, not only rank 0
                verdict[0] = f"checkpoint.remote.url={cfg.remote.url!r} is not usable: {e}"
    dist.broadcast_object_list(verdict, src=0, group=control_group)
    if verdict[0] is not None:
        raise RuntimeError(verdict[0])
    peer_on = "peer" in cfg.tiers
    return CheckpointContext(
        cfg=cfg, job_id=cfg.job_id, layout=ShardLayout.from_parallel_state(ps), rank=ps.rank,
        world_size=ps.world_size, node_name=ps.node_name, num_nodes=ps.num_nodes, local_rank=ps.local_rank,
        replica_holder_rank=ps.replica_holder_rank if peer_on else None,
        replica_owner_rank=ps.replica_owner_rank if peer_on else None,
        local=local, remote=remote, control_group=control_group, peer_group=peer_group,
        incarnation=verdict[1], fault=fault, timeout_s=timeout_s,
    )
