"""The Tier-3 owner lease: one live writer per job prefix, takeover only from a released or lapsed holder."""
from __future__ import annotations

import pytest

from megatier.checkpoint.commit.lease import LeaseHeld, OwnerLease
from megatier.checkpoint.storage.directory import DirectoryStore

pytestmark = pytest.mark.timeout(60)


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _lease(store, incarnation: str, clock: Clock, lease_s: float = 10.0) -> OwnerLease:
    lease = OwnerLease(store, incarnation, lease_s, clock=clock, sleep=clock.sleep)
    lease._renew_loop = lambda: None  # renew by hand: the test drives time
    return lease


def test_a_live_holder_is_never_taken_over_and_the_refusal_names_it(tmp_path):
    store, clock = DirectoryStore(str(tmp_path)), Clock()
    a = _lease(store, "launchA", clock)
    a.acquire()
    b = _lease(store, "launchB", clock)
    b.sleep = lambda s: (clock.sleep(s), a.renew())  # A keeps renewing while B waits
    with pytest.raises(LeaseHeld, match=r"in use by a live run of this job: incarnation launchA on host .*pid"):
        b.acquire()
    assert a.lost is None and a.newest().incarnation == "launchA"


def test_a_released_lease_is_taken_at_once_and_a_lapsed_one_after_it_lapses(tmp_path):
    store, clock = DirectoryStore(str(tmp_path)), Clock()
    a = _lease(store, "launchA", clock)
    a.acquire()
    a.release()
    b = _lease(store, "launchB", clock)
    b.acquire()
    assert clock.now == 1000.0 and b.held.generation == 2
    clock.now += 5  # B crashes: no more renewals
    c = _lease(store, "launchC", clock)
    c.acquire()  # waits out the rest of B's lease, then takes over
    assert c.held.generation == 3 and clock.now > 1000.0 + 10
    b.renew()  # B comes back (it only looked dead): it sees that it lost the lease
    assert b.lost is not None and "launchC" in b.lost
    assert sorted(store.list("_owner/")) == ["_owner/g00000003.json"]


def test_two_launches_racing_for_a_free_lease_get_one_winner(tmp_path):
    store, clock = DirectoryStore(str(tmp_path)), Clock()
    a, b = _lease(store, "A", clock), _lease(store, "B", clock)
    assert a._take(1, clock.now) and not b._take(1, clock.now)
