"""The collectives of the checkpoint system, behind one small interface.

The manager and recovery talk to other ranks only through a
:class:`CheckpointComm`: object and integer all-gathers (the inventory, status
rounds, the watermark sync), point-to-point byte transfers (recovery's
cascade) and a barrier (close). :class:`GroupComm` runs them on gloo groups
with the job's timeout; :class:`SoloComm` is a world of one, so the policy and
the recovery path can be tested with in-memory tiers and no process group.

Every wait is bounded (the group's timeout); a transfer that does not complete
names the peer rank and the timeout.
"""
from __future__ import annotations

import abc
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

_TAG_HDR, _TAG_DATA = 0x7301, 0x7302


class CheckpointComm(abc.ABC):
    """The checkpoint system's view of the job's ranks."""

    rank: int
    world_size: int

    @abc.abstractmethod
    def gather(self, item: Any) -> list:
        """Every rank's ``item`` (picklable), in rank order, on every rank."""

    @abc.abstractmethod
    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (equal lengths), in rank order, on every rank."""

    @abc.abstractmethod
    def send(self, data: Optional[bytes], dst: int) -> None:
        """Send ``data`` to ``dst`` (None: tell it there is nothing, e.g. a copy that failed its check)."""

    @abc.abstractmethod
    def recv(self, src: int) -> Optional[bytes]:
        """The bytes ``src`` sends (None when it had nothing)."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Wait until every rank got here."""


class GroupComm(CheckpointComm):
    """Collectives on ``control_group``, transfers on ``transfer_group``; both gloo, every wait bounded."""

    def __init__(self, control_group: dist.ProcessGroup, transfer_group: dist.ProcessGroup, timeout_s: float):
        self.control = control_group
        self.transfer = transfer_group
        self.timeout_s = timeout_s
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def gather(self, item: Any) -> list:
        out: list = [None] * self.world_size
        dist.all_gather_object(out, item, group=self.control)
        return out

    def gather_ints(self, values: list[int]) -> list[list[int]]:
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

    def barrier(self) -> None:
        dist.barrier(group=self.control)

    def _wait(self, work, peer: int) -> None:
        if work.wait(timedelta(seconds=self.timeout_s)) is False:
            raise TimeoutError(f"no completion from rank {peer} within {self.timeout_s:g} s; it may have died")


class SoloComm(CheckpointComm):
    """A world of one: gathers return this rank's item; there is nobody to send to."""

    rank, world_size = 0, 1

    def gather(self, item: Any) -> list:
        return [item]

    def gather_ints(self, values: list[int]) -> list[list[int]]:
        return [list(values)]

    def send(self, data: Optional[bytes], dst: int) -> None:
        raise RuntimeError(f"a world of one has no rank {dst} to send to")

    def recv(self, src: int) -> Optional[bytes]:
        raise RuntimeError(f"a world of one has no rank {src} to receive from")

    def barrier(self) -> None:
        pass
