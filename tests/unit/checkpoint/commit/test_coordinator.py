"""Coordinator: recovery-point arithmetic, background commits and watermark-driven Tier-3 reclamation."""
import time

import pytest

from megatier.checkpoint.commit.coordinator import Coordinator
from megatier.checkpoint.commit.reader import RemoteReader
from megatier.checkpoint.commit.records import list_units
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.storage.directory import DirectoryStore
from tests.checkpoint_fakes import JOB, WORLD, base, diff

pytestmark = pytest.mark.timeout(60)


def _wait(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


def test_commits_in_background_and_reports_the_rack_recovery_point(tmp_path, upload_all):
    store = DirectoryStore(str(tmp_path / "t3"))
    units = {r: [base(0, r), diff(1, 5, r), diff(6, 10, r)] for r in range(WORLD)}
    units[3] = units[3][:2]  # rank 3 has not uploaded 6..10 yet: that batch must not commit
    for u in upload_all(store, units).values():
        u.wait(10)
    coord = Coordinator(store, JOB, WORLD, keep_bases=1, poll_s=0.05).start()
    try:
        _wait(lambda: coord.recovery_point() == 5)
        assert coord.newest_base() == 0
        assert RemoteReader(store, JOB).committed_diffs() == [(1, 5)]
    finally:
        coord.close(5)


def test_reclaims_only_behind_the_published_watermark(tmp_path, upload_all):
    store = DirectoryStore(str(tmp_path / "t3"))
    units = {r: [base(0, r), diff(1, 5, r), base(5, r), diff(6, 10, r), base(10, r)] for r in range(WORLD)}
    for u in upload_all(store, units).values():
        u.wait(10)
    coord = Coordinator(store, JOB, WORLD, keep_bases=1, poll_s=0.05).start()
    try:
        _wait(lambda: coord.newest_base() == 10)
        assert PayloadId.base(0) in list_units(store)  # no watermark yet: nothing goes
        coord.set_watermark(10)
        # keep_bases=1 keeps base 10; diffs after the base preceding W (5) stay for one more interval.
        # Reclamation deletes one unit at a time, so wait for the whole expected set, not one unit.
        left = sorted([PayloadId.base(10), PayloadId.diff(6, 10)])
        _wait(lambda: sorted(list_units(store)) == left)
        coord.set_watermark(5)  # the watermark never goes back
        time.sleep(0.2)
        assert sorted(list_units(store)) == left
    finally:
        coord.close(5)


class CountingStore(DirectoryStore):
    """A directory store that counts listings of the base folder (one per coordinator poll)."""

    def __init__(self, root: str):
        super().__init__(root)
        self.listings = 0

    def children(self, prefix):
        if prefix == "base/":
            self.listings += 1
        return super().children(prefix)


def test_polls_only_while_a_nudged_unit_waits_for_markers(tmp_path, upload_all):
    store = CountingStore(str(tmp_path / "t3"))
    for u in upload_all(store, {r: [base(0, r)] for r in range(WORLD)}).values():
        u.wait(10)
    coord = Coordinator(store, JOB, WORLD, keep_bases=1, poll_s=0.02).start()
    try:
        _wait(lambda: coord.newest_base() == 0)
        time.sleep(0.1)  # let the first poll finish
        idle = store.listings
        time.sleep(0.3)  # 15 poll periods with nothing awaited: no poll
        assert store.listings == idle
        # Rank 0 marks 1..5 done first; the others' markers come later: polls go on until it commits.
        upload_all(store, {0: [diff(1, 5, 0)]}, {0: {"on_done": coord.nudge}})[0].wait(10)
        time.sleep(0.2)
        assert store.listings >= idle + 3 and coord.recovery_point() == 0
        for u in upload_all(store, {r: [diff(1, 5, r)] for r in range(1, WORLD)}).values():
            u.wait(10)
        _wait(lambda: coord.recovery_point() == 5)
        time.sleep(0.1)
        settled = store.listings
        time.sleep(0.3)
        assert store.listings <= settled + 1  # at most the poll in flight when the unit committed
    finally:
        coord.close(5)


class ListingStore(DirectoryStore):
    """A directory store that records every listing prefix asked for."""

    def __init__(self, root: str):
        super().__init__(root)
        self.prefixes: list[str] = []

    def list(self, prefix=""):
        self.prefixes.append(prefix)
        return super().list(prefix)


def test_a_poll_lists_only_the_units_not_known_committed(tmp_path, upload_all):
    store = ListingStore(str(tmp_path / "t3"))
    units = {r: [base(0, r), diff(1, 5, r), diff(6, 10, r)] for r in range(WORLD)}
    units[3] = units[3][:2]  # rank 3 has not uploaded 6..10 yet
    for u in upload_all(store, units).values():
        u.wait(10)
    coord = Coordinator(store, JOB, WORLD, keep_bases=1, poll_s=30.0)
    coord.poll_once()
    assert coord.recovery_point() == 5
    store.prefixes.clear()
    coord.poll_once()  # base 0 and 1..5 are known committed: only 6..10 is listed, never the whole job
    assert store.prefixes == ["diff/v00000006-00000010/"]
    upload_all(store, {3: [diff(6, 10, 3)]})[3].wait(10)
    coord.poll_once()
    assert coord.recovery_point() == 10
    store.prefixes.clear()
    coord.poll_once()
    assert store.prefixes == []
    # A unit removed behind its back (here: by hand) is forgotten; the store's own listing agrees.
    for key in list_units(store)[PayloadId.diff(6, 10)].objects:
        store.delete(key)
    coord.poll_once()
    assert coord.recovery_point() == 5


def test_a_first_poll_lists_the_whole_job_once_not_each_unit(tmp_path, upload_all):
    """A launch's first poll knows no unit: one request per unit would keep a launch that dies soon after its
    restore from ever reaching the reclamation."""
    store = ListingStore(str(tmp_path / "t3"))
    units = {r: [base(0, r), *(diff(s, s + 4, r) for s in range(1, 50, 5)), base(50, r)] for r in range(WORLD)}
    for u in upload_all(store, units).values():
        u.wait(10)
    coord = Coordinator(store, JOB, WORLD, keep_bases=1, poll_s=30.0)
    coord.set_watermark(50)
    coord.poll_once()
    assert coord.recovery_point() == 50 and coord.newest_base() == 50
    # One listing of the job to learn the 12 units, one more by the reclamation (and its look at the set-aside
    # areas): never one per unit.
    assert store.prefixes == ["", "", "_quarantine/", "_superseded/"]
    # Base 0 is reclaimed; the diffs after it stay for one more interval (the reclaim policy's rule).
    assert PayloadId.base(0) not in list_units(store) and len(list_units(store)) == 11


def test_the_unit_folders_of_a_store_are_listed_one_level_deep(tmp_path):
    from megatier.checkpoint.commit.records import unit_ids
    from megatier.checkpoint.storage.store import ObjectStore

    store = DirectoryStore(str(tmp_path / "t3"))
    for key in ("base/v00000000/a", "diff/v00000001-00000005/rank00000.done.json", "diff/v00000006-00000010/x/y",
                "fingerprints/f.json", "_quarantine/base/v00000000/t/a"):
        store.put(key, b"1")
    assert store.children("diff/") == {"v00000001-00000005", "v00000006-00000010"}
    assert store.children("nothing/") == set()
    assert ObjectStore.children(store, "diff/") == store.children("diff/")  # the contract's own listing
    assert unit_ids(store) == {PayloadId.base(0), PayloadId.diff(1, 5), PayloadId.diff(6, 10)}
