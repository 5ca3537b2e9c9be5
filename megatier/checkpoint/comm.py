"""The collectives of the checkpoint system, behind one small interface.

The manager and recovery talk to other ranks only through a
:class:`CheckpointComm`: object and integer all-gathers (the inventory, status
rounds, the watermark sync), point-to-point byte transfers (recovery's
cascade, and the node leaders' exchange of its decision) and a barrier
(close). :class:`GroupComm` runs them on gloo groups with the job's timeout;
:class:`SoloComm` is a world of one, so the policy and the recovery path can
be tested with in-memory tiers and no process group.

Every wait is bounded (the group's timeout). A collective that does not
complete names what it was (the caller's ``what``: operation and step) and the
ranks that never reached it: before each collective a rank marks its arrival
on the job's rendezvous store, so the ranks that did arrive can tell which did
not (a stopped, hung or dead process). The marks are written by a helper
thread (:class:`_Board`), in order: each is a round trip to the store, which
the loop would otherwise pay twice at every batch end for the watermark sync;
a mark lands milliseconds later, long before any timeout reads the board. The
watermark sync's all-gather itself runs on another helper thread
(:meth:`GroupComm.gather_ints_async`): even starting gloo's asynchronous
all-gather holds the caller for milliseconds. A transfer that does not
complete names the peer rank and the timeout.
"""
from __future__ import annotations

import abc
import logging
import queue
from concurrent.futures import Future
from datetime import timedelta
from typing import Any, Callable, Iterable, Optional, TypeVar

import torch
import torch.distributed as dist

from megatier.checkpoint.threads import helper_thread

log = logging.getLogger(__name__)

_TAG_HDR, _TAG_DATA = 0x7301, 0x7302
T = TypeVar("T")


def _default_store() -> Optional[dist.Store]:
    """The job's rendezvous store (the arrival board), where torch exposes it."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # a private accessor: without it, timeouts just cannot name the absent ranks
        return None


class _InOrder:
    """Runs the callables handed to it one at a time, in the order given, on a helper thread (started at the
    first); each one's outcome comes back through its Future."""

    def __init__(self, name: str):
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._started = False

    def submit(self, fn: Callable[[], T]) -> "Future[T]":
        future: Future = Future()
        if not self._started:
            helper_thread(self._run, self.name).start()
            self._started = True
        self._jobs.put((fn, future))
        return future

    def close(self) -> None:
        """Let the helper thread end once the jobs before now are done (and drop the last one's closure, which
        holds its process group: in-process recovery frees the old groups while the process lives on)."""
        if self._started:
            self._jobs.put(None)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, future = job
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to whoever waits for it
                future.set_exception(e)


class _Board:
    """Arrival marks on the job's store, written in order on a helper thread (``set`` and ``delete`` return at
    once); reads (``check``) go to the store directly."""

    def __init__(self, store: dist.Store):
        self.store = store
        self._writes = _InOrder("megatier-board")

    def set(self, key: str) -> None:
        self._writes.submit(lambda: self._write(key, True))

    def delete(self, key: str) -> None:
        self._writes.submit(lambda: self._write(key, False))

    def check(self, keys: list[str]) -> bool:
        return self.store.check(keys)

    def close(self) -> None:
        self._writes.close()

    def _write(self, key: str, put: bool) -> None:
        try:
            self.store.set(key, b"1") if put else self.store.delete_key(key)
        except Exception as e:  # a store that went away: only the timeout diagnosis loses this mark
            log.debug("arrival mark %s on the store failed: %s", key, e)


class CheckpointTimeout(RuntimeError):
    """A checkpoint collective or transfer did not complete; the message names the operation and the ranks."""


class CheckpointComm(abc.ABC):
    """The checkpoint system's view of the job's ranks."""

    rank: int
    world_size: int

    @abc.abstractmethod
    def gather(self, item: Any, what: str = "a checkpoint collective") -> list:
        """Every rank's ``item`` (picklable), in rank order, on every rank; ``what`` names it in errors."""

    def abandon(self) -> None:
        """The world broke (in-process recovery): end this comm's helper threads; it is not used again."""

    @abc.abstractmethod
    def gather_ints(self, values: list[int], what: str = "a checkpoint collective") -> list[list[int]]:
        """Every rank's ``values`` (equal lengths), in rank order, on every rank."""

    @abc.abstractmethod
    def broadcast(self, item: Any, src: int = 0, what: str = "a checkpoint collective") -> Any:
        """Rank ``src``'s ``item`` (picklable) on every rank (the others' argument is ignored). Unlike
        :meth:`gather`, whose every item is padded to the largest, one big item costs each rank its size once."""

    @abc.abstractmethod
    def collect(self, item: Any, what: str = "a checkpoint collective") -> Optional[list]:
        """Every rank's ``item`` in rank order on rank 0, None on the others: each rank but 0 receives nothing."""

    @abc.abstractmethod
    def scatter(self, items: Optional[list], what: str = "a checkpoint collective") -> Any:
        """Rank 0's ``items[r]`` on each rank r (the others pass None): each rank receives only its own."""

    def gather_ints_async(self, values: list[int], what: str = "a checkpoint collective") -> "PendingInts":
        """Start :meth:`gather_ints`; its rows come from the returned handle's ``wait`` (every rank must start
        the same gathers in the same order, and wait for each before a blocking collective of this comm)."""
        return PendingInts(self.gather_ints(values, what))

    @abc.abstractmethod
    def send(self, data: Optional[bytes], dst: int) -> None:
        """Send ``data`` to ``dst`` (None: tell it there is nothing, e.g. a copy that failed its check)."""

    @abc.abstractmethod
    def recv(self, src: int) -> Optional[bytes]:
        """The bytes ``src`` sends (None when it had nothing)."""

    @abc.abstractmethod
    def exchange(self, outgoing: dict[int, bytes], sources: Iterable[int]) -> dict[int, bytes]:
        """Send ``outgoing[dst]`` to each ``dst`` and receive one message from each of ``sources`` (never this
        rank), all at once: unlike :meth:`send` and :meth:`recv` in turn, ranks that send to each other cannot
        wait on each other."""

    @abc.abstractmethod
    def barrier(self, what: str = "a checkpoint barrier") -> None:
        """Wait until every rank got here."""


class PendingInts:
    """The handle of :meth:`CheckpointComm.gather_ints_async`: ``done()`` without blocking, ``wait()`` -> rows."""

    def __init__(self, rows: Optional[list[list[int]]] = None, finish: Optional[Callable[[], list[list[int]]]] = None,
                 done: Optional[Callable[[], bool]] = None):
        self._rows, self._finish, self._done = rows, finish, done

    def done(self) -> bool:
        return self._rows is not None or (self._done is not None and self._done())

    def wait(self) -> list[list[int]]:
        if self._rows is None:
            self._rows = self._finish()
        return self._rows


class GroupComm(CheckpointComm):
    """Collectives on ``control_group``, transfers on ``transfer_group``; both gloo, every wait bounded."""

    def __init__(self, control_group: dist.ProcessGroup, transfer_group: dist.ProcessGroup, timeout_s: float,
                 board: Optional[dist.Store] = None):
        self.control = control_group
        self.transfer = transfer_group
        self.timeout_s = timeout_s
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        store = board if board is not None else _default_store()
        self.board = _Board(store) if store is not None else None
        self._seq = 0
        # The started (async) gathers run here: even starting an asynchronous gloo all-gather holds the caller
        # for milliseconds. In order, so every rank runs them in the same order.
        self._background = _InOrder("megatier-ckpt-sync")

    def abandon(self) -> None:
        self._background.close()
        if self.board is not None:
            self.board.close()

    def _key(self, seq: int, rank: int) -> str:
        return f"megatier/ckpt/{seq}/{rank}"

    def _collective(self, what: str, run: Callable[[], T]) -> T:
        """``run`` a collective, first marking this rank's arrival; on failure, name who never arrived."""
        seq = self._arrive()
        try:
            out = run()
        except Exception as e:  # gloo's timeout, or the connection of a peer that died
            raise self._timeout(what, seq, e) from e
        self._left(seq)
        return out

    def _arrive(self) -> int:
        self._seq += 1
        if self.board is not None:
            self.board.set(self._key(self._seq, self.rank))
        return self._seq

    def _left(self, seq: int) -> None:
        if self.board is not None and seq > 1:
            self.board.delete(self._key(seq - 1, self.rank))

    def _timeout(self, what: str, seq: int, e: Exception) -> CheckpointTimeout:
        return CheckpointTimeout(f"{what} did not complete on rank {self.rank} within {self.timeout_s:g} s: "
                                 f"{self._absent(seq)} ({type(e).__name__}: {e})")

    def _absent(self, seq: int) -> str:
        if self.board is None:
            return "a rank may be stopped, hung or dead"
        missing = [r for r in range(self.world_size) if not self.board.check([self._key(seq, r)])]
        if not missing:
            return "every rank reached it, so the link to one failed"
        return f"ranks {missing} never reached it (stopped, hung or dead)"

    def gather(self, item: Any, what: str = "a checkpoint collective") -> list:
        out: list = [None] * self.world_size
        self._collective(what, lambda: dist.all_gather_object(out, item, group=self.control))
        return out

    def gather_ints(self, values: list[int], what: str = "a checkpoint collective") -> list[list[int]]:
        return self._collective(what, lambda: self._all_gather_ints(values))

    def broadcast(self, item: Any, src: int = 0, what: str = "a checkpoint collective") -> Any:
        box = [item if self.rank == src else None]
        self._collective(what, lambda: dist.broadcast_object_list(box, src=src, group=self.control))
        return box[0]

    def collect(self, item: Any, what: str = "a checkpoint collective") -> Optional[list]:
        out = [None] * self.world_size if self.rank == 0 else None
        self._collective(what, lambda: dist.gather_object(item, out, dst=0, group=self.control))
        return out

    def scatter(self, items: Optional[list], what: str = "a checkpoint collective") -> Any:
        box: list = [None]
        self._collective(what, lambda: dist.scatter_object_list(box, items if self.rank == 0 else None, src=0,
                                                                group=self.control))
        return box[0]

    def gather_ints_async(self, values: list[int], what: str = "a checkpoint collective") -> PendingInts:
        """:meth:`gather_ints` on a helper thread; the caller waits for it before its next blocking collective
        (the contract above), so this comm's collectives still run in one order on every rank."""
        seq = self._arrive()
        future = self._background.submit(lambda: self._all_gather_ints(values))

        def finish() -> list[list[int]]:
            try:
                rows = future.result(timeout=self.timeout_s)
            except Exception as e:
                raise self._timeout(what, seq, e) from e
            self._left(seq)
            return rows

        return PendingInts(finish=finish, done=future.done)

    def _all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """The all-gather of :meth:`gather_ints` without the arrival marks (its caller keeps them)."""
        mine = torch.tensor(values, dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(rows, mine, group=self.control)
        return [row.tolist() for row in rows]

    def send(self, data: Optional[bytes], dst: int) -> None:
        header = torch.tensor([len(data) if data is not None else -1], dtype=torch.int64)
        self._wait(dist.isend(header, dst=dst, group=self.transfer, tag=_TAG_HDR), dst)
        if data is not None:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self._wait(dist.isend(buf, dst=dst, group=self.transfer, tag=_TAG_DATA), dst)

    def recv(self, src: int) -> Optional[bytes]:
        header = torch.zeros(1, dtype=torch.int64)
        self._wait(dist.irecv(header, src=src, group=self.transfer, tag=_TAG_HDR), src)
        size = int(header.item())
        if size < 0:
            return None
        buf = torch.empty(size, dtype=torch.uint8)
        if size:
            self._wait(dist.irecv(buf, src=src, group=self.transfer, tag=_TAG_DATA), src)
        return buf.numpy().tobytes()

    def exchange(self, outgoing: dict[int, bytes], sources: Iterable[int]) -> dict[int, bytes]:
        pending = []  # (work, peer, the tensor it holds: alive until the work completes)
        for dst, data in outgoing.items():
            header = torch.tensor([len(data)], dtype=torch.int64)
            pending.append((dist.isend(header, dst=dst, group=self.transfer, tag=_TAG_HDR), dst, header))
            if data:
                buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                pending.append((dist.isend(buf, dst=dst, group=self.transfer, tag=_TAG_DATA), dst, buf))
        headers = {src: torch.zeros(1, dtype=torch.int64) for src in sources}
        for src, header in headers.items():
            self._wait(dist.irecv(header, src=src, group=self.transfer, tag=_TAG_HDR), src)
        received = {src: torch.empty(int(header.item()), dtype=torch.uint8) for src, header in headers.items()}
        receives = [(dist.irecv(buf, src=src, group=self.transfer, tag=_TAG_DATA), src, buf)
                    for src, buf in received.items() if buf.numel()]
        for work, peer, _ in receives + pending:
            self._wait(work, peer)
        return {src: buf.numpy().tobytes() for src, buf in received.items()}

    def barrier(self, what: str = "a checkpoint barrier") -> None:
        self._collective(what, lambda: dist.barrier(group=self.control))

    def _wait(self, work, peer: int) -> None:
        try:
            done = work.wait(timedelta(seconds=self.timeout_s))
        except Exception as e:
            raise CheckpointTimeout(f"transfer with rank {peer} failed: {e}; it may have died") from e
        if done is False:
            raise CheckpointTimeout(f"no completion from rank {peer} within {self.timeout_s:g} s; it may have died")


class SoloComm(CheckpointComm):
    """A world of one: gathers return this rank's item; there is nobody to send to."""

    rank, world_size = 0, 1

    def gather(self, item: Any, what: str = "") -> list:
        return [item]

    def gather_ints(self, values: list[int], what: str = "") -> list[list[int]]:
        return [list(values)]

    def broadcast(self, item: Any, src: int = 0, what: str = "") -> Any:
        return item

    def collect(self, item: Any, what: str = "") -> Optional[list]:
        return [item]

    def scatter(self, items: Optional[list], what: str = "") -> Any:
        return items[0]

    def send(self, data: Optional[bytes], dst: int) -> None:
        raise RuntimeError(f"a world of one has no rank {dst} to send to")

    def recv(self, src: int) -> Optional[bytes]:
        raise RuntimeError(f"a world of one has no rank {src} to receive from")

    def exchange(self, outgoing: dict[int, bytes], sources: Iterable[int]) -> dict[int, bytes]:
        if outgoing or list(sources):
            raise RuntimeError("a world of one has no other rank to exchange with")
        return {}

    def barrier(self, what: str = "") -> None:
        pass
