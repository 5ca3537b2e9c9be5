"""The Tier-2 ring protocol: replicate this rank's payloads into the node memory of its ring peer.

Every rank is a sender (its own units go to ``holder_rank``, the same local rank
on the next node) and a receiver (it keeps ``owner_rank``'s units under
``replica/rank<owner>``). The manager calls :meth:`PeerReplicator.on_step` on
every rank at every step, with units at the same steps on every rank, so the
traffic of the ring is symmetric and fully determined by the sequence of calls.

Protocol. ``on_step`` only queues a *tick* (the step and its new units); one
daemon thread per rank, the only user of ``group`` (and only from the first tick
on, so recovery may use the group before), processes the ticks in order.
``flush`` queues a tick that forces everything out, so it is collective too.
A tick runs in phases; in each, a rank posts every receive first and only then
waits, so a phase completes once each peer has reached the same phase of the
same tick (no cycle of waits can form around the ring):

1. headers (only at ticks with new units): a fixed-size int64 table, one row per
   slot (diff or step unit, base: present, first, last, size, stamp length) to the holder
   (and, on rings of 3+ nodes, to the owner, which needs our size to agree on
   pacing), then the stamp JSON bytes to the holder. Diverging schedules are
   detected here and stop replication with an error instead of a hang.
2. data: each leg's due chunks move (the pacing plan, computed alike at both
   ends from the headers, is in :mod:`.ring`). A new base (or a flush) forces
   every remaining chunk of the previous one to move in that tick: the only
   synchronous flush, which ``on_step`` reports as stall. The ``t2.mid_chunk``
   crash point is called on the sender after every chunk of a base but its last.
3. acks: a receiver whose leg got its last chunk verifies it (size + xxh64),
   publishes it, and sends [ok, kind, first, last] back; the sender records the
   unit in ``acked_units`` only on ok. A bad copy is discarded, never visible, and
   only reported in ``last_error``: the sender still has its own Tier-1 copy and
   Tier-3, and the next unit replaces it.

Invariants:
- A replica becomes visible only through :meth:`NodeMemory.save` (diff batches
  and step units, after verify_payload) or :meth:`ReplicaWriter.finish` (bases, after the checksum):
  a sender that dies mid-base leaves an invisible temp file, which the thread
  discards when it stops; one that dies mid-record (``t2.mid_record``: after
  the headers, before the data) leaves nothing of it, and the replica's
  earlier units stay complete and usable.
- Every wait has a timeout; a failed or timed-out transfer stops the thread and
  the next on_step/flush raises naming both ranks and the unit. The group is
  unusable afterwards (a gloo op may still be posted), so nothing is retried.
- ``on_step`` blocks only while waiting for work of ticks it already queued,
  which peers complete once they reach the same step: a stall never depends on
  a peer getting past a later collective.
- No unit is dropped: a backlog beyond a few diff batches or step units blocks the caller instead.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from megatier.checkpoint.format.payload import EncodedPayload, PayloadError, Stamp, verify_payload
from megatier.checkpoint.format.units import BASE, DIFF, STEP, PayloadId
from megatier.checkpoint.storage.store import StoreError
from megatier.checkpoint.threads import helper_thread
from megatier.checkpoint.tiers.node_memory import NodeMemory
from megatier.checkpoint.tiers.ring import KIND_CODES, SLOTS, Leg, PeerStatus, Tick, TransferError, chunk_plan
from megatier.faults import CrashPoint, FaultHook, no_faults

log = logging.getLogger(__name__)

_TAG_HDR, _TAG_HDR_BACK, _TAG_STAMP, _TAG_DATA, _TAG_ACK = 0x7201, 0x7202, 0x7203, 0x7204, 0x7205
_MAX_QUEUED_DIFFS = 1  # diff batches or step units not yet acknowledged: more would let a node failure lose
# more than the two steps its class allows (the one in flight and the one handed over); the loop waits instead


class PeerReplicator:
    """Rank ``rank``'s Tier-2 sender (to ``holder_rank``) and receiver (from ``owner_rank``); see the module doc."""

    def __init__(self, local: NodeMemory, *, rank: int, holder_rank: int, owner_rank: int, group,
                 base_interval: int, max_chunk_bytes: int, timeout_s: float,
                 fault_hook: FaultHook = no_faults):
        if rank in (holder_rank, owner_rank):
            raise ValueError(f"rank {rank} cannot replicate to itself (holder {holder_rank}, owner {owner_rank})")
        if base_interval < 1 or max_chunk_bytes < 1 or timeout_s <= 0:
            raise ValueError("base_interval, max_chunk_bytes and timeout_s must be positive")
        self.local, self.rank, self.holder, self.owner, self.group = local, rank, holder_rank, owner_rank, group
        self.base_interval, self.max_chunk_bytes, self.timeout_s = base_interval, max_chunk_bytes, timeout_s
        self.fault_hook = fault_hook
        self._timeout = timedelta(seconds=timeout_s)
        self._cv = threading.Condition()
        # Shared with the thread, guarded by _cv.
        self._ticks: collections.deque[Tick] = collections.deque()
        self._queued = self._ticks_done = self._progress = 0
        self._queued_diffs = self._bases_in = self._bases_done = 0
        self._unsent = 0
        self._acked: dict = {DIFF: None, BASE: None, STEP: None}
        self._received: collections.deque[PayloadId] = collections.deque(maxlen=256)
        self._last_error: Optional[str] = None
        self._error: Optional[BaseException] = None
        self._spills = 0
        self._base_chunks: collections.deque[tuple[int, int, int]] = collections.deque(maxlen=1024)
        self._last_step = -1
        self._stop = self._closed = False
        # Thread-only: legs in creation order (same order on both ends of each direction).
        self._out: list[Leg] = []
        self._in: list[Leg] = []
        self._bases_started = 0
        self._thread = helper_thread(self._run, f"megatier-t2-rank{rank}")
        self._thread.start()

    # ---- main thread ----------------------------------------------------------------------------
    def on_step(self, step: int, *, diff: Optional[EncodedPayload] = None,
                base: Optional[EncodedPayload] = None) -> float:
        """Hand this step's new units (if any) to the replicator; returns seconds the caller was blocked (stall).

        Every rank must hand in units of the same kinds and ranges at the same steps. Steps must increase;
        a call without units for a step already seen is ignored.
        """
        for kinds, p in (((DIFF, STEP), diff), ((BASE,), base)):
            if p is not None and (p.stamp.pid.kind not in kinds or p.stamp.rank != self.rank):
                raise ValueError(f"{p.stamp.pid} of rank {p.stamp.rank} handed to rank {self.rank}'s replicator "
                                 f"as its {' or '.join(kinds)}")
        with self._cv:
            self._raise_if_failed()
            if self._closed:
                raise RuntimeError(f"Tier-2 replicator of rank {self.rank} is closed")
            if step <= self._last_step:
                if diff is None and base is None:
                    return 0.0  # a repeated tick (e.g. a drain at close) has nothing to pace
                raise ValueError(f"on_step({step}) after on_step({self._last_step}): steps must increase")
            self._last_step = step
            earlier_bases = self._bases_in
            self._enqueue(Tick(step, diff, base))
            self._queued_diffs += diff is not None
            self._bases_in += base is not None
            self._unsent += sum(p.stamp.size for p in (diff, base) if p is not None)
            backlog = self._queued_diffs > _MAX_QUEUED_DIFFS
        stall = 0.0
        if base is not None and earlier_bases:  # the previous base must be complete before this one starts
            stall += self._block(lambda: self._bases_done >= earlier_bases,
                                 f"finishing the base before {base.stamp.pid}")
        if backlog:
            stall += self._block(lambda: self._queued_diffs <= _MAX_QUEUED_DIFFS, "draining the diff backlog")
        return stall

    def status(self) -> PeerStatus:
        with self._cv:
            return PeerStatus(self._unsent, dict(self._acked), tuple(self._received), self._last_error,
                              self._spills, tuple(self._base_chunks))

    def flush(self, timeout: float) -> None:
        """Move, verify and ack everything handed in so far; collective: every rank must call it at the same point."""
        with self._cv:
            self._raise_if_failed()
            if self._closed:
                raise RuntimeError(f"Tier-2 replicator of rank {self.rank} is closed")
            token = self._enqueue(Tick(self._last_step, flush=True))
        self._block(lambda: self._ticks_done >= token, "flushing", deadline=time.monotonic() + timeout)

    def close(self, timeout: float) -> None:
        """Flush (best effort, collective like :meth:`flush`), then stop the thread."""
        if not self._closed:
            try:
                self.flush(timeout)
            except Exception as e:  # close must not raise; the cause stays visible in status()
                log.warning("Tier-2 replicator of rank %d closed with transfers unfinished: %s", self.rank, e)
        with self._cv:
            self._closed = self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=min(5.0, self.timeout_s))

    def abort(self, timeout: float) -> None:
        """Stop without the collective flush (the world broke): a transfer in flight ends with its group, and
        a half-received unit is dropped (the thread's exit); what was stored stays."""
        with self._cv:
            self._closed = self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=min(timeout, self.timeout_s))

    def _enqueue(self, tick: Tick) -> int:
        self._ticks.append(tick)
        self._queued += 1
        self._cv.notify_all()
        return self._queued

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(str(self._error)) from self._error

    def _block(self, done, what: str, deadline: Optional[float] = None) -> float:
        """Wait for ``done()`` (under the lock); raise on a thread error, or when the thread makes no progress
        for two op timeouts (or ``deadline`` passes). Returns the seconds waited."""
        start = time.monotonic()
        with self._cv:
            mark, since = self._progress, start
            while True:
                self._raise_if_failed()
                if done():
                    return time.monotonic() - start
                now = time.monotonic()
                if self._progress != mark:
                    mark, since = self._progress, now
                limit = deadline if deadline is not None else since + 2 * self.timeout_s + 1.0
                if now >= limit:
                    raise RuntimeError(f"Tier-2 replication of rank {self.rank} (to rank {self.holder}, from rank "
                                       f"{self.owner}) timed out {what}; the peer may have died")
                self._cv.wait(min(limit - now, 1.0))

    # ---- replication thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._ticks and not self._stop:
                        self._cv.wait()
                    if self._stop:
                        return
                    tick = self._ticks[0]
                self._process(tick)
                with self._cv:
                    self._ticks.popleft()
                    self._ticks_done += 1
                    self._queued_diffs -= tick.diff is not None
                    self._progress += 1
                    self._cv.notify_all()
        except BaseException as e:  # a transfer failure, a fault hook's simulated crash, or a bug
            if not isinstance(e, TransferError):
                e = RuntimeError(f"Tier-2 replicator of rank {self.rank} stopped: {e!r}")
            log.error("%s", e)
            with self._cv:
                self._error, self._last_error = e, str(e)
                self._cv.notify_all()
        finally:
            for leg in self._in:  # whatever was half received stays invisible; drop its temp file
                if leg.writer is not None:
                    leg.writer.abort()

    def _process(self, tick: Tick) -> None:
        if tick.base is not None or tick.flush:
            forced = [leg for leg in self._out + self._in if leg.done < leg.n and (tick.flush or leg.pid.kind == BASE)]
            for leg in forced:
                leg.forced = True
            if forced and not tick.flush:
                with self._cv:
                    self._spills += 1
        if tick.diff is not None or tick.base is not None:
            self._start_units(tick)
        finished = self._move_chunks(tick.step)
        self._ack(finished)

    def _start_units(self, tick: Tick) -> None:
        mine = (tick.diff, tick.base)
        stamps = [p.stamp.to_json() if p is not None else b"" for p in mine]
        hdr = torch.tensor([[1, p.stamp.pid.first, p.stamp.pid.last, p.stamp.size, len(s)] if p is not None
                            else [0, 0, 0, 0, 0] for p, s in zip(mine, stamps)], dtype=torch.int64)
        label = next(p.stamp.pid for p in mine if p is not None)
        from_owner, from_holder = torch.empty_like(hdr), torch.empty_like(hdr)
        self._exchange([("recv", from_owner, _TAG_HDR, label)] + [("send", hdr, _TAG_HDR, label)] +
                       ([("recv", from_holder, _TAG_HDR_BACK, label), ("back", hdr, _TAG_HDR_BACK, label)]
                        if self.holder != self.owner else []))
        if self.holder == self.owner:
            from_holder = from_owner
        theirs = from_owner.tolist()
        for kind, p, row in zip(SLOTS, mine, theirs):
            if bool(row[0]) != (p is not None) or (p is not None and (row[1], row[2]) != (p.stamp.pid.first,
                                                                                           p.stamp.pid.last)):
                raise TransferError(f"Tier-2 schedules diverged at step {tick.step}: rank {self.owner} handed in "
                                     f"{kind} {row[1:3] if row[0] else None}, rank {self.rank} "
                                     f"{p.stamp.pid if p is not None else None}; replication stopped")
        stamp_in = torch.empty(sum(r[4] for r in theirs), dtype=torch.uint8)
        self._exchange([("recv", stamp_in, _TAG_STAMP, label),
                        ("send", torch.frombuffer(bytearray(b"".join(stamps)), dtype=torch.uint8), _TAG_STAMP, label)])
        raw, at = stamp_in.numpy().tobytes(), 0
        for p, row, holder_row in zip(mine, theirs, from_holder.tolist()):
            if p is None:
                continue
            source = f"rank {self.owner}'s Tier-2 header"
            stamp = Stamp.from_json(raw[at:at + row[4]], source)
            at += row[4]
            if stamp.rank != self.owner or stamp.pid != p.stamp.pid or stamp.size != row[3]:
                raise TransferError(f"{source} announces {stamp.pid} of rank {stamp.rank} ({stamp.size} bytes), "
                                     f"expected {p.stamp.pid} of rank {self.owner}; replication stopped")
            if stamp.pid.replays:
                self.fault_hook(CrashPoint.T2_MID_RECORD, stamp.pid.version)
                self._out.append(Leg(p.stamp.pid, p.stamp.size, p.stamp.size, 1, tick.step, 0, data=p.data))
                self._in.append(Leg(stamp.pid, stamp.size, stamp.size, 1, tick.step, 0, stamp=stamp))
                continue
            index, self._bases_started = self._bases_started, self._bases_started + 1
            chunk, n, span = chunk_plan(p.stamp.size, holder_row[3], self.base_interval, self.max_chunk_bytes)
            self._out.append(Leg(p.stamp.pid, p.stamp.size, chunk, n, tick.step + 1, span, data=p.data,
                                  base_index=index))
            chunk, n, span = chunk_plan(stamp.size, p.stamp.size, self.base_interval, self.max_chunk_bytes)
            leg = Leg(stamp.pid, stamp.size, chunk, n, tick.step + 1, span, stamp=stamp, base_index=index)
            try:
                leg.writer = self.local.begin_replica(stamp)
            except StoreError as e:  # still receive every chunk (the peer sends them anyway), keep nothing
                leg.bad = f"replica of rank {self.owner}'s {leg.pid} discarded: {e}"
            self._in.append(leg)

    def _out_chunk(self, leg: Leg, k: int) -> torch.Tensor:
        """Chunk ``k`` of an outgoing leg as a uint8 tensor (a copy: gloo wants a writable buffer)."""
        a, b = leg.bounds(k)
        return torch.frombuffer(bytearray(memoryview(leg.data)[a:b]), dtype=torch.uint8)

    def _move_chunks(self, step: int) -> list[Leg]:
        """Phase 2: post every due receive, then send due chunks one by one (fault point between base chunks)."""
        recvs, started = [], {id(leg): leg.done for leg in self._out + self._in}
        for leg in self._in:
            for k in leg.due(step):
                a, b = leg.bounds(k)
                buf = torch.empty(b - a, dtype=torch.uint8)
                recvs.append((leg, buf, self._post("recv", buf, _TAG_DATA, leg.pid)))
        sent: collections.Counter = collections.Counter()  # base version -> chunks sent this tick
        for leg in self._out:
            for k in leg.due(step):
                chunk = self._out_chunk(leg, k)
                self._wait(self._post("send", chunk, _TAG_DATA, leg.pid), leg.pid)
                leg.done += 1
                if leg.pid.kind == BASE:
                    sent[leg.pid.version] += 1
                with self._cv:
                    self._unsent -= chunk.numel()
                    self._progress += 1
                if leg.pid.kind == BASE and leg.done < leg.n:
                    self.fault_hook(CrashPoint.T2_MID_CHUNK, leg.pid.version)
        for leg, buf, work in recvs:
            self._wait(work, leg.pid)
            leg.done += 1
            self._take(leg, buf)
        with self._cv:
            self._base_chunks.extend((version, step, count) for version, count in sent.items())
        return [leg for leg in self._out + self._in if leg.done == leg.n and started[id(leg)] < leg.n]

    def _take(self, leg: Leg, buf: torch.Tensor) -> None:
        """Keep a received chunk; after the last one, verify and publish (or discard) the replica."""
        last = leg.done == leg.n
        try:
            if leg.bad is not None:
                pass
            elif leg.pid.kind == BASE:
                leg.writer.append(memoryview(buf.numpy()))
                if last:
                    leg.writer.finish()
            else:
                leg.parts.append(buf)
                if last:
                    data = b"".join(t.numpy().tobytes() for t in leg.parts)
                    verify_payload(data, leg.stamp, f"Tier-2 replica of rank {self.owner}'s {leg.pid}")
                    self.local.save(EncodedPayload(data, leg.stamp), replica=True)
        except (PayloadError, StoreError, OSError) as e:
            leg.bad = f"replica of rank {self.owner}'s {leg.pid} discarded: {e}"
            if leg.writer is not None:
                leg.writer.abort()  # idempotent; nothing of this copy becomes visible
        if not last:
            return
        leg.writer, leg.parts = None, []
        with self._cv:
            if leg.bad is None:
                self._received.append(leg.pid)
            else:
                log.warning("Tier-2: %s", leg.bad)
                self._last_error = leg.bad

    def _ack(self, finished: list[Leg]) -> None:
        """Phase 3: ack each incoming leg completed this tick to the owner, collect the holder's acks."""
        to_owner = [leg for leg in finished if leg.stamp is not None]  # incoming legs carry the owner's stamp
        from_holder = [(leg, torch.empty(4, dtype=torch.int64)) for leg in finished if leg.stamp is None]
        self._exchange([("recv", buf, _TAG_ACK, leg.pid) for leg, buf in from_holder] +
                       [("back", torch.tensor([int(leg.bad is None), KIND_CODES.index(leg.pid.kind), leg.pid.first,
                                               leg.pid.last]), _TAG_ACK, leg.pid) for leg in to_owner])
        with self._cv:
            for leg, buf in from_holder:
                ok, kind, first, last = buf.tolist()
                if (KIND_CODES[kind], first, last) != (leg.pid.kind, leg.pid.first, leg.pid.last):
                    raise TransferError(f"rank {self.holder} acked {KIND_CODES[kind]} v{first}-{last} where rank "
                                         f"{self.rank} expected {leg.pid}; replication stopped")
                if ok:
                    newest = self._acked[leg.pid.kind]
                    self._acked[leg.pid.kind] = leg.pid if newest is None else max(newest, leg.pid)
                else:
                    self._last_error = f"rank {self.holder} rejected {leg.pid} of rank {self.rank} (size or checksum)"
            self._out = [leg for leg in self._out if leg.done < leg.n]
            self._in = [leg for leg in self._in if leg.done < leg.n]
            active = [leg.base_index for leg in self._out + self._in if leg.base_index >= 0]
            self._bases_done = min(active) if active else self._bases_started
            self._progress += 1

    def _post(self, op: str, tensor: torch.Tensor, tag: int, pid: PayloadId):
        """Start a gloo op; returns (work, src, dst). Along the ring: "send" to the holder, "recv" from the owner;
        against it (headers' back copy, acks): "back" to the owner, "recv" of those tags from the holder."""
        if op == "recv":
            src, dst = (self.holder if tag in (_TAG_HDR_BACK, _TAG_ACK) else self.owner), self.rank
        else:
            src, dst = self.rank, (self.holder if op == "send" else self.owner)
        try:
            if op == "recv":
                return dist.irecv(tensor, src=src, group=self.group, tag=tag), src, dst
            return dist.isend(tensor, dst=dst, group=self.group, tag=tag), src, dst
        except Exception as e:
            raise self._failure(pid, src, dst, e) from e

    def _wait(self, posted, pid: PayloadId) -> None:
        work, src, dst = posted
        try:
            if work.wait(self._timeout) is False:
                raise TimeoutError(f"no completion within {self.timeout_s:g} s")
        except Exception as e:
            raise self._failure(pid, src, dst, e) from e

    def _exchange(self, ops: list) -> None:
        """Post all ``(op, tensor, tag, pid)`` (receives first in the list), then wait for each."""
        posted = [(pid, self._post(op, t, tag, pid)) for op, t, tag, pid in ops]
        for pid, p in posted:
            self._wait(p, pid)
        with self._cv:
            self._progress += 1

    @staticmethod
    def _failure(pid: PayloadId, src: int, dst: int, e: Exception) -> "TransferError":
        return TransferError(f"Tier-2 transfer of {pid} from rank {src} to rank {dst} failed: {e}; "
                              f"the peer may have died")
