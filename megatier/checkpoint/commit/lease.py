"""The Tier-3 owner lease: one live writer per job prefix at a time.

Two launches that share ``checkpoint.job_id`` and ``checkpoint.remote.url``
would otherwise swap state: one recovers the other's base, and its cleanup
deletes the other's uncommitted units. So global rank 0 holds a lease on the
job's Tier-3 prefix from start-up (before restore lists or deletes anything)
to exit:

    _owner/g00000007.json   {"generation": 7, "incarnation", "host", "pid", "renewed_at", "lease_s", "released"}

- Taking it: the newest generation is free when it is released, past its
  lease (``renewed_at + lease_s`` before now) or our own; then generation+1 is
  created with a conditional create, so of two launches racing for it exactly
  one wins. Older generations are deleted.
- Holding it: a helper thread rewrites our generation's ``renewed_at`` every
  third of the lease. Seeing a newer generation means another launch took over
  (we looked dead: a partition, a long stall); the holder then reports the
  lease lost and the run stops writing to Tier-3 with an error.
- A live holder is never taken over: a launch that finds one renewed within
  the lease waits up to one lease for it to lapse, then refuses to start with a
  message that names the holder. A launch after a crash waits out the rest of
  the dead holder's lease (at once when the holder ran on the same host and its
  process is gone); a clean exit, or a launch that fails before training,
  releases it at once.

Clocks: ``renewed_at`` is the holder's wall clock, compared with the taker's;
keep hosts NTP-synchronised well within ``lease_s``.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

from megatier.checkpoint.storage.store import ObjectNotFound, ObjectStore, RetryPolicy, StoreError, retry_call
from megatier.checkpoint.threads import helper_thread

log = logging.getLogger(__name__)
PREFIX = "_owner/"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process with that pid: alive
        return True
    return True


class LeaseHeld(RuntimeError):
    """Another live launch writes this job's Tier-3 prefix."""


@dataclass(frozen=True)
class Lease:
    generation: int
    incarnation: str
    host: str
    pid: int
    renewed_at: float
    lease_s: float
    released: bool = False

    def key(self) -> str:
        return f"{PREFIX}g{self.generation:08d}.json"

    def free_at(self, now: float, incarnation: str) -> bool:
        """Whether a launch of ``incarnation`` may take over at ``now``: the holder released it, its lease
        lapsed, or it ran on this host and its process is gone (a crash: no need to wait the lease out)."""
        if self.released or self.incarnation == incarnation or now > self.renewed_at + self.lease_s:
            return True
        return self.host == socket.gethostname() and not _process_alive(self.pid)

    def describe(self, now: float) -> str:
        return (f"incarnation {self.incarnation} on host {self.host} (pid {self.pid}), renewed "
                f"{max(0.0, now - self.renewed_at):.0f} s ago")


class OwnerLease:
    """Rank 0's hold on the job's Tier-3 prefix (see the module docstring)."""

    def __init__(self, store: ObjectStore, incarnation: str, lease_s: float, *,
                 clock: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep):
        self.store, self.incarnation, self.lease_s = store, incarnation, lease_s
        self.clock, self.sleep = clock, sleep
        self.held: Optional[Lease] = None
        self.lost: Optional[str] = None  # why we no longer hold it
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def newest(self) -> Optional[Lease]:
        keys = sorted(self.store.list(PREFIX))
        for key in reversed(keys):
            try:
                return Lease(**json.loads(self.store.get(key)))
            except ObjectNotFound:
                continue  # replaced by a newer generation while we listed
            except (ValueError, TypeError) as e:  # an unreadable record: look at the one before
                log.warning("ignoring lease record %s: %s", self.store.describe(key), e)
        return None

    def acquire(self) -> None:
        """Take the lease, waiting up to one lease for a live holder to lapse; LeaseHeld if it does not."""
        deadline = self.clock() + self.lease_s + 1.0
        while True:
            current, now = retry_call(self.newest, RetryPolicy(), "reading the Tier-3 lease"), self.clock()
            if current is None or current.free_at(now, self.incarnation):
                generation = (current.generation if current else 0) + 1
                take = functools.partial(self._take, generation, now)
                if retry_call(take, RetryPolicy(), "taking the Tier-3 lease"):
                    return
                continue  # another launch took that generation first: look again
            if now >= deadline:
                raise LeaseHeld(f"Tier-3 at {self.store.url} is in use by a live run of this job: "
                                f"{current.describe(now)}. Stop that run, or give this one another "
                                f"checkpoint.job_id (or checkpoint.remote.url)")
            self.sleep(min(1.0, deadline - now))

    def _take(self, generation: int, now: float) -> bool:
        lease = Lease(generation, self.incarnation, socket.gethostname(), os.getpid(), now, self.lease_s)
        if not self.store.put_if_absent(lease.key(), json.dumps(asdict(lease)).encode()):
            return False
        self.held = lease
        for key in self.store.list(PREFIX):
            if key < lease.key():
                self.store.delete(key)
        self._thread = helper_thread(self._renew_loop, "megatier-t3-lease")
        self._thread.start()
        return True

    def renew(self) -> None:
        """Rewrite our record's ``renewed_at``, unless a newer generation shows we lost the lease."""
        newest = self.newest()
        if newest is not None and newest.generation > self.held.generation:
            self.lost = f"{newest.describe(self.clock())} took over the Tier-3 lease"
            return
        self.held = Lease(**{**asdict(self.held), "renewed_at": self.clock()})
        self.store.put(self.held.key(), json.dumps(asdict(self.held)).encode())

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.lease_s / 3) and self.lost is None:
            try:
                self.renew()
            except StoreError as e:  # keep trying; past the lease another launch may take over, and we see it
                log.debug("renewing the Tier-3 lease at %s failed: %s", self.store.url, e)

    def release(self) -> None:
        """Stop renewing and mark the record released, so the next launch starts at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self.held is None or self.lost is not None:
            return
        try:
            self.store.put(self.held.key(), json.dumps({**asdict(self.held), "released": True}).encode())
        except StoreError as e:
            log.warning("releasing the Tier-3 lease at %s failed (the next launch waits it out): %s",
                        self.store.url, e)
