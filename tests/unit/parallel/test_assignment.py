"""Who takes which rank after a failure: survivors keep theirs, spares fill the holes nearest first, and a
world that cannot be made whole shrinks its data parallelism or gives up."""
from __future__ import annotations

import itertools
import random

import pytest

from megatier.parallel.assignment import Assignment, Member, assign_ranks
from megatier.parallel.layout import coordinates_of


def _world(nodes: int, per_node: int) -> list[Member]:
    return [Member(f"node{n}/{i}", f"node{n}") for n in range(nodes) for i in range(per_node)]


def _spares(node: str, k: int) -> list[Member]:
    return [Member(f"{node}/spare{i}", node) for i in range(k)]


def test_a_crashed_process_is_replaced_by_a_spare_on_its_own_node():
    world = _world(2, 2)  # tp=2 x dp=2
    joined = [m for r, m in enumerate(world) if r != 1] + _spares("node1", 1) + _spares("node0", 1)
    a = assign_ranks((2, 1, 2), world, joined, shrink=False)
    assert a.holders == ("node0/0", "node0/spare0", "node1/0", "node1/1")
    assert a.idle == ("node1/spare0",) and a.rank_of("node0/spare0") == 1 and a.rank_of("node1/spare0") is None


def test_a_lost_node_is_replaced_by_a_node_of_spares_in_local_order():
    world = _world(2, 2)
    joined = world[:2] + _spares("node2", 2)[::-1]
    a = assign_ranks((2, 1, 2), world, joined, shrink=False)
    assert a.holders == ("node0/0", "node0/1", "node2/spare0", "node2/spare1") and a.idle == ()


def test_without_a_whole_spare_node_the_holes_take_any_spare_from_the_fullest_node():
    world = _world(2, 2)
    joined = world[:2] + _spares("node2", 1) + _spares("node3", 1)
    a = assign_ranks((2, 1, 2), world, joined, shrink=False)
    assert a.holders == ("node0/0", "node0/1", "node2/spare0", "node3/spare0")


def test_without_spares_the_incomplete_replica_is_dropped_and_dp_shrinks():
    world = _world(2, 2)  # tp=2 x dp=2: replica 0 on node0, replica 1 on node1
    a = assign_ranks((2, 1, 2), world, [m for r, m in enumerate(world) if r != 1], shrink=True)
    assert (a.tp, a.pp, a.dp) == (2, 1, 1) and a.holders == ("node1/0", "node1/1") and a.idle == ("node0/0",)
    assert assign_ranks((2, 1, 2), world, world[2:], shrink=False) is None  # not allowed to shrink


def test_a_shrink_keeps_only_as_many_replicas_as_the_job_can_train_with():
    world = _world(4, 2)  # tp=2 x dp=4 on 4 nodes; replica d on node d
    joined = [m for r, m in enumerate(world) if r != 7]  # replica 3 broken: 3 whole ones left
    three = assign_ranks((2, 1, 4), world, joined, shrink=True)
    assert three.dp == 3 and three.holders == tuple(m.id for m in world[:6]) and three.idle == ("node3/0",)
    even = assign_ranks((2, 1, 4), world, joined, shrink=True, dp_ok=lambda dp: 8 % dp == 0)  # a batch of 8
    assert even.dp == 2 and even.holders == tuple(m.id for m in world[:4])
    assert set(even.idle) == {"node2/0", "node2/1", "node3/0"}
    assert assign_ranks((2, 1, 4), world, joined, shrink=True, dp_ok=lambda dp: dp > 3) is None


def test_shrinking_keeps_every_survivor_in_its_pipeline_stage_and_tensor_slot():
    world = _world(4, 1)  # tp=1 pp=2 dp=2: ranks 0, 1 in stage 0 (dp 0, 1); 2, 3 in stage 1
    a = assign_ranks((1, 2, 2), world, [m for r, m in enumerate(world) if r != 3], shrink=True)
    assert (a.pp, a.dp) == (2, 1) and a.holders == ("node0/0", "node2/0") and a.idle == ("node1/0",)


def test_with_no_whole_replica_left_the_round_cannot_complete():
    world = _world(2, 2)
    assert assign_ranks((2, 1, 2), world, [world[0], world[2]], shrink=True) is None


def test_a_world_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="layout of tp=2 pp=1 dp=2"):
        assign_ranks((2, 1, 2), _world(1, 2), [], shrink=True)


@pytest.mark.parametrize("seed", range(40))
def test_survivors_always_keep_their_rank_and_coordinates(seed):
    rng = random.Random(seed)
    tp, pp, dp = rng.choice([(1, 1, 4), (2, 1, 2), (1, 2, 2), (2, 2, 2), (1, 4, 2)])
    per_node = rng.choice([1, 2])
    world = _world(tp * pp * dp // per_node, per_node)
    alive = [m for m in world if rng.random() > 0.3]
    spares = list(itertools.chain.from_iterable(_spares(f"node{n}", rng.randint(0, 2)) for n in range(len(world))))
    a = assign_ranks((tp, pp, dp), world, alive + spares, shrink=True)
    if a is None:
        return
    assert isinstance(a, Assignment) and len(set(a.holders)) == len(a.holders) == a.world_size
    assert not set(a.holders) & set(a.idle) and set(a.holders) | set(a.idle) <= {m.id for m in alive + spares}
    for r, h in enumerate(a.holders):
        if h in {m.id for m in world}:
            old = [m.id for m in world].index(h)
            t, _, p = coordinates_of(old, tp=tp, dp=dp)
            assert coordinates_of(r, tp=a.tp, dp=a.dp)[::2] == (t, p)  # same tensor slot and stage
            if a.dp == dp:
                assert r == old  # a whole world: every survivor keeps its rank
    assert Assignment.from_dict(a.to_dict()) == a
