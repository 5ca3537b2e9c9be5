"""The diff-chain walk every recovery point is computed with."""
from megatier.checkpoint.format.chain import chain_end, chain_to, reachable, replay_ends
from megatier.checkpoint.format.units import PayloadId


def d(first: int, last: int) -> PayloadId:
    return PayloadId.diff(first, last)


def test_chain_end():
    assert chain_end(set(), {d(1, 5)}) is None
    assert chain_end({0}, set()) == 0
    assert chain_end({0}, {d(1, 5), d(6, 10), d(16, 20)}) == 10
    assert chain_end({0, 50}, {d(1, 5), d(51, 55)}) == 55
    assert chain_end({50}, {d(46, 50), d(51, 55), d(56, 60)}) == 60


def test_overlapping_batches_after_a_rebase_reach_the_furthest_end():
    # A run recovered at E=7 re-based there: batches 6-10 (the failed run's) and 8-12 (the resumed one's).
    batches = {d(1, 5), d(6, 7), d(6, 10), d(8, 12)}
    assert chain_end({0}, batches) == 12
    reach = reachable(0, batches)
    assert chain_to(reach, 0, 12) == [PayloadId.base(0), d(1, 5), d(6, 7), d(8, 12)]
    assert chain_to(reach, 0, 10) == [PayloadId.base(0), d(1, 5), d(6, 10)]


def test_a_batch_before_the_base_is_not_part_of_its_chain():
    assert reachable(50, {d(46, 50), d(51, 55)}) == {50: None, **{s: d(51, 55) for s in range(51, 56)}}


def test_a_chain_may_stop_inside_a_batch_and_go_on_from_inside_one():
    s = PayloadId.step
    # Rank A's open batch 6-10 landed (its step units went with it); rank B has only step units 6..9.
    a, b = {d(1, 5), d(6, 10)}, {d(1, 5), s(6), s(7), s(8), s(9)}
    common = set(reachable(0, a)) & set(reachable(0, b))
    assert max(common) == 9
    chain = chain_to(reachable(0, a), 0, 9)
    assert chain == [PayloadId.base(0), d(1, 5), d(6, 10)] and replay_ends(chain, 9) == [0, 5, 9]
    # A later batch starting inside an earlier one (a run re-based at E=7): the first is cut at 7.
    chain = chain_to(reachable(0, {d(1, 5), d(6, 10), d(8, 12)}), 0, 12)
    assert chain == [PayloadId.base(0), d(1, 5), d(6, 10), d(8, 12)] and replay_ends(chain, 12) == [0, 5, 7, 12]
    assert replay_ends([PayloadId.base(3)], 3) == [3]
