"""Who takes which rank after a failure: the pure decision of a membership round.

Every process of a job has an id that it keeps for life (its launch slot: ``node0/1``, or a spare's
``node2/spare0``) and a node. The round's inputs are the layout the job ran with, the member holding each
of its ranks, and the members that joined the round: the surviving ranks' holders and idle hot spares.
:func:`assign_ranks` decides, deterministically:

* every surviving rank keeps its rank, so its model, optimizer and data objects stay valid;
* a lost rank is taken by a spare on its own node when there is one (a process crash: that node's memory
  still holds the lost rank's units), else a node that lost every rank is replaced by a node of spares,
  its ranks mapped in local order (the ring peer's memory holds their units), else by any spare left,
  from the node with the most;
* if ranks stay unfilled and shrinking is allowed, the data-parallel replicas that are not whole are
  dropped and the whole ones renumbered (fewer dp: the elastic path), their survivors becoming spares;
  as many whole replicas are kept as the job can train with (``dp_ok``: the global batch must split
  evenly), the others' members idle too. With no such replica left, or shrinking not allowed, the round
  cannot complete (None): the job falls back to a relaunch.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

from megatier.parallel.layout import coordinates_of, rank_of


@dataclass(frozen=True)
class Member:
    """A process of the job: its lifelong id and its node."""

    id: str
    node: str


@dataclass(frozen=True)
class Assignment:
    """The outcome of a round: the new degrees, the holder of each new rank, and the processes left idle."""

    tp: int
    pp: int
    dp: int
    holders: tuple[str, ...]  # member id by new rank
    idle: tuple[str, ...] = field(default=())  # spares not needed, survivors of dropped replicas

    @property
    def world_size(self) -> int:
        return len(self.holders)

    def rank_of(self, member_id: str) -> Optional[int]:
        """The new rank of member ``member_id``, or None when it has none."""
        try:
            return self.holders.index(member_id)
        except ValueError:
            return None

    def to_dict(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "holders": list(self.holders), "idle": list(self.idle)}

    @classmethod
    def from_dict(cls, d: dict) -> Assignment:
        return cls(int(d["tp"]), int(d["pp"]), int(d["dp"]), tuple(d["holders"]), tuple(d["idle"]))


def _fill(nodes: list[str], lost: list[int], spares: list[Member]) -> dict[int, str]:
    """Spares for as many lost ranks as possible: same node, then whole spare nodes, then any."""
    free: dict[str, list[str]] = defaultdict(list)
    for s in sorted(spares, key=lambda s: (s.node, s.id)):
        free[s.node].append(s.id)
    taken: dict[int, str] = {}
    for r in lost:  # a process crash: a spare beside it
        if free[nodes[r]]:
            taken[r] = free[nodes[r]].pop(0)
    alive_nodes = {nodes[r] for r in range(len(nodes)) if r not in lost}
    by_node: dict[str, list[int]] = defaultdict(list)
    for r in lost:
        if r not in taken:
            by_node[nodes[r]].append(r)
    for node in sorted(by_node):  # a lost node: a node of spares takes its ranks in local order
        ranks = by_node[node]
        spare_nodes = [n for n in sorted(free) if n not in alive_nodes and len(free[n]) >= len(ranks)]
        if node not in alive_nodes and spare_nodes:
            for r in ranks:
                taken[r] = free[spare_nodes[0]].pop(0)
    for r in lost:  # whatever is left, from the node with the most spares
        if r not in taken and any(free.values()):
            node = max(sorted(free), key=lambda n: len(free[n]))
            taken[r] = free[node].pop(0)
    return taken


def assign_ranks(degrees: tuple[int, int, int], world: list[Member], joined: list[Member], *,
                 shrink: bool, dp_ok: Callable[[int], bool] = lambda dp: True) -> Optional[Assignment]:
    """The new world after the members of ``world`` (by rank) missing from ``joined`` were lost; the members
    of ``joined`` outside ``world`` are idle spares (see the module docstring). ``degrees``: (tp, pp, dp) of
    the job; ``shrink``: whether dp may shrink; ``dp_ok``: whether the job can train with that many replicas."""
    tp, pp, dp = degrees
    if len(world) != tp * pp * dp:
        raise ValueError(f"{len(world)} ranks' members for a layout of tp={tp} pp={pp} dp={dp}")
    held = {m.id for m in world}
    present = {m.id for m in joined}
    lost = [r for r, m in enumerate(world) if m.id not in present]
    spares = sorted((m for m in joined if m.id not in held), key=lambda s: (s.node, s.id))
    taken = _fill([m.node for m in world], lost, spares)
    holders = [taken.get(r) if r in lost else m.id for r, m in enumerate(world)]
    used = set(taken.values())
    idle = [s.id for s in spares if s.id not in used]
    if all(h is not None for h in holders):
        return Assignment(tp, pp, dp, tuple(holders), tuple(idle))
    if not shrink:
        return None
    whole = [d for d in range(dp) if all(holders[rank_of(t, d, p, tp=tp, dp=dp)] is not None
                                         for t in range(tp) for p in range(pp))]
    kept = max((k for k in range(1, len(whole) + 1) if dp_ok(k)), default=0)
    if not kept:
        return None
    whole = whole[:kept]
    new = [""] * (tp * pp * kept)
    for r, h in enumerate(holders):
        t, d, p = coordinates_of(r, tp=tp, dp=dp)
        if d in whole:
            new[rank_of(t, whole.index(d), p, tp=tp, dp=kept)] = h
        elif h is not None:
            idle.append(h)  # a survivor or a spare of a dropped replica waits for a later round
    return Assignment(tp, pp, kept, tuple(new), tuple(idle))
