"""ParallelState: the 3D layout of this job with its process groups, built at start (and again when in-process
recovery re-forms the job) and passed explicitly.

Rank order (the one formula) is in :mod:`megatier.parallel.layout`.

Nodes are identified by name: the hostname, unless MEGATIER_NODE_NAME sets it
(the simulated cluster names its nodes node0, node1, ...). Every launcher gives
the same name, so a relaunch through another launcher finds its node memory;
torchrun's GROUP_RANK is not used, since c10d may hand it to another node at
each rendezvous. Nodes are indexed in natural name order, so node{i} has index i
and the Tier-2 ring node n -> node n+1 does not depend on which global ranks a
rendezvous handed each node.
"""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megatier.parallel.layout import Layout, coordinates_of, rank_of


def init_process_group(backend: str, timeout_s: float, store: Optional[dist.Store] = None) -> None:
    """Initialise torch.distributed from torchrun's environment, or as a world of one.

    Without ``RANK``/``WORLD_SIZE`` in the environment (plain ``python
    pretrain_gpt.py``) a single-process group on an in-memory store is created,
    so every code path still receives real process groups. ``store``: rendezvous there instead of at
    MASTER_ADDR (an epoch of in-process recovery's membership store), with RANK and WORLD_SIZE from the
    environment.
    """
    if dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s)
    if store is not None:
        dist.init_process_group(backend=backend, store=store, rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def node_identity() -> tuple[str, int]:
    """This process's node name (MEGATIER_NODE_NAME, else the hostname) and local rank."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return os.environ.get("MEGATIER_NODE_NAME") or socket.gethostname(), local_rank


@dataclass(frozen=True)
class ParallelState(Layout):
    """Degrees, this rank's coordinates (``rank``, ``world_size``: see Layout), its node, the ring peers
    and the process groups."""

    node_name: str
    node_index: int
    num_nodes: int
    local_rank: int
    # Ring peer (docs/architecture.md): same local rank on node (n + 1) % nodes holds our replica;
    # we hold the replica of the same local rank on node (n - 1) % nodes.
    replica_holder_rank: Optional[int]
    replica_owner_rank: Optional[int]
    tp_group: dist.ProcessGroup = field(repr=False)
    pp_group: dist.ProcessGroup = field(repr=False)
    dp_group: dist.ProcessGroup = field(repr=False)
    # First and last pipeline stage of this (dp, tp) column; None when pp == 1 or off those stages.
    embedding_group: Optional[dist.ProcessGroup] = field(repr=False)
    world_group: dist.ProcessGroup = field(repr=False)
    # Gloo group over all ranks reserved for checkpoint traffic, so it never queues behind training collectives.
    checkpoint_group: dist.ProcessGroup = field(repr=False)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    node_names: tuple[str, ...] = ()  # every node of the job, in ring order
    # Expert parallelism (parallel.ep; :func:`expert_coordinates`): this rank's ep rank, the group its tokens are
    # dispatched over and the group its experts' shards are reduced over; both None at ep=1 (the dp group then
    # holds every expert).
    ep: int = 1
    ep_rank: int = 0
    ep_group: Optional[dist.ProcessGroup] = field(default=None, repr=False)
    expert_dp_group: Optional[dist.ProcessGroup] = field(default=None, repr=False)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def global_rank(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return rank_of(tp_rank, dp_rank, pp_rank, tp=self.tp, dp=self.dp)

    def pp_neighbour(self, offset: int) -> int:
        """Global rank of the stage ``offset`` away in this rank's pipeline."""
        return self.global_rank(self.tp_rank, self.dp_rank, self.pp_rank + offset)

    def describe(self) -> str:
        return (
            f"rank {self.rank}/{self.world_size} tp={self.tp_rank}/{self.tp} dp={self.dp_rank}/{self.dp} "
            f"pp={self.pp_rank}/{self.pp} node={self.node_name}({self.node_index}/{self.num_nodes}) "
            f"local_rank={self.local_rank} replica_holder={self.replica_holder_rank} "
            f"replica_owner={self.replica_owner_rank}"
        )


_GROUP_ROLES = ("tp_group", "pp_group", "dp_group", "embedding_group", "world_group", "checkpoint_group", "ep_group",
                "expert_dp_group")


def detach_groups(holders, state: ParallelState) -> list[tuple[object, str, str]]:
    """Clear every attribute of ``holders`` (objects, e.g. a model's modules, an optimizer) that holds one of
    ``state``'s process groups; returns (holder, attribute, role) for :func:`attach_groups`.

    In-process recovery needs this before the membership round: a gloo group closes its connections only once
    nothing refers to it, and until then a peer blocked on this rank waits for its collective's timeout instead
    of failing at once."""
    roles = {id(getattr(state, role)): role for role in _GROUP_ROLES if getattr(state, role) is not None}
    detached = []
    for holder in holders:
        for name, value in list(vars(holder).items()):
            if isinstance(value, dist.ProcessGroup) and id(value) in roles:
                detached.append((holder, name, roles[id(value)]))
                setattr(holder, name, None)
    return detached


def attach_groups(detached: list[tuple[object, str, str]], state: ParallelState) -> None:
    """Point what :func:`detach_groups` cleared at ``state``'s group of the same role (the re-formed world)."""
    for holder, name, role in detached:
        setattr(holder, name, getattr(state, role))


def _node_order_key(name: str) -> list:
    """Natural order of node names: node2 before node10, so node{i} gets index i."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]


def _ring_peers(rank: int, identities: list[tuple[str, int]]) -> tuple[list[str], Optional[int], Optional[int]]:
    """Node order and this rank's replica holder/owner.

    Nodes are ordered by name, not by which ranks they got: an elastic
    re-rendezvous may hand a node different global ranks, but the ring of node
    names (and so which node holds whose Tier-2 replica) stays the same.
    """
    nodes = sorted({name for name, _ in identities}, key=_node_order_key)
    by_slot = {(name, local): r for r, (name, local) in enumerate(identities)}
    name, local = identities[rank]
    if len(nodes) < 2:
        return nodes, None, None
    n = nodes.index(name)
    holder = by_slot.get((nodes[(n + 1) % len(nodes)], local))
    owner = by_slot.get((nodes[(n - 1) % len(nodes)], local))
    return nodes, holder, owner


def expert_coordinates(dp_rank: int, dp: int, ep: int) -> tuple[int, int]:
    """(ep rank, expert-data-parallel rank) of data-parallel rank ``dp_rank``: dp_rank = ep_rank * (dp / ep) +
    expert-dp rank, so an ep group takes every (dp / ep)-th dp rank and each rank's expert shard covers the same
    elements under every ep (megatier.optim.flat.FlatLayout)."""
    return dp_rank // (dp // ep), dp_rank % (dp // ep)


def build_parallel_state(tp: int, pp: int, timeout_s: float, device: torch.device, ep: int = 1) -> ParallelState:
    """Create every process group of the layout. All ranks must call this in the same order."""
    if not dist.is_initialized():
        raise RuntimeError("build_parallel_state needs torch.distributed initialised (see init_process_group)")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if world_size % (tp * pp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by parallel.tp={tp} x parallel.pp={pp}; "
            f"launch a multiple of {tp * pp} processes"
        )
    dp = world_size // (tp * pp)
    if dp % ep != 0:
        raise ValueError(f"parallel.ep={ep} does not divide the data-parallel degree {dp} (world size {world_size} "
                         f"/ tp={tp} / pp={pp}); launch a multiple of {tp * pp * ep} processes or lower parallel.ep")
    timeout = timedelta(seconds=timeout_s)
    tp_rank, dp_rank, pp_rank = coordinates_of(rank, tp=tp, dp=dp)

    def coords(t: int, d: int, p: int) -> int:
        return rank_of(t, d, p, tp=tp, dp=dp)

    def make_groups(rank_lists: list[list[int]]) -> Optional[dist.ProcessGroup]:
        # new_group is collective over the world: every rank creates every group, keeps its own.
        mine = None
        for ranks in rank_lists:
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine = group
        return mine

    tp_group = make_groups([[coords(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)])
    dp_group = make_groups([[coords(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)])
    pp_group = make_groups([[coords(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)])
    embedding_group = None
    if pp > 1:
        embedding_group = make_groups([[coords(t, d, 0), coords(t, d, pp - 1)] for d in range(dp) for t in range(tp)])
    ep_group = expert_dp_group = None
    if ep > 1:
        edp = dp // ep
        ep_group = make_groups([[coords(t, i * edp + j, p) for i in range(ep)]
                                for p in range(pp) for t in range(tp) for j in range(edp)])
        expert_dp_group = make_groups([[coords(t, i * edp + j, p) for j in range(edp)]
                                       for p in range(pp) for t in range(tp) for i in range(ep)])
    world_group = dist.new_group(list(range(world_size)), timeout=timeout)
    checkpoint_group = dist.new_group(list(range(world_size)), timeout=timeout, backend="gloo")

    identities: list = [None] * world_size
    dist.all_gather_object(identities, node_identity(), group=checkpoint_group)
    nodes, holder, owner = _ring_peers(rank, identities)
    node_name, local_rank = identities[rank]
    return ParallelState(
        tp=tp, pp=pp, dp=dp,
        tp_rank=tp_rank, pp_rank=pp_rank, dp_rank=dp_rank,
        node_name=node_name, node_index=nodes.index(node_name), num_nodes=len(nodes), local_rank=local_rank,
        replica_holder_rank=holder, replica_owner_rank=owner,
        tp_group=tp_group, pp_group=pp_group, dp_group=dp_group, embedding_group=embedding_group,
        world_group=world_group, checkpoint_group=checkpoint_group, device=device, node_names=tuple(nodes),
        ep=ep, ep_rank=expert_coordinates(dp_rank, dp, ep)[0], ep_group=ep_group, expert_dp_group=expert_dp_group,
    )
