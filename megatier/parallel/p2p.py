"""Point-to-point exchange of activations and their gradients between adjacent pipeline stages.

Between stages i and i+1 of one pipeline only two streams exist: activations
flow i -> i+1 and their gradients flow i+1 -> i. Every exchange of one call is
posted at once with ``batch_isend_irecv`` and then waited on, so a stage that
sends forward while its neighbour sends backward cannot deadlock, whatever
order the backend serves the messages in (gloo's send may block until the
matching receive is posted). Messages of one direction between one pair are
matched in order, so no tags are needed; only the interleaved schedule's ring
transfers, which may be posted in any order, carry tags.

Every wait on a transfer is timed on :attr:`PipelineComm.clock` (``pp_bubble_ms``): the time this stage sat
idle for its neighbours, its share of the pipeline bubble (a receive whose sender is still computing, or a
send the receiver has not taken yet).

Peers are addressed by their rank in the pipeline group, which equals the
pipeline stage because the group lists its ranks in stage order.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megatier.optim.wait_clock import WaitClock


def bubble_ms(comm: Optional["PipelineComm"]) -> dict[str, float]:
    """A step record's ``pp_bubble_ms``: ``comm``'s since the last read, 0.0 without a pipeline (None)."""
    return comm.take_bubble_ms() if comm is not None else {"pp_bubble_ms": 0.0}


class PipelineComm:
    """Send/receive of (micro_batch, seq_len, hidden) tensors to the previous and next stage.

    Calls that have no partner on this stage (receiving forward on the first
    stage, sending forward from the last, ...) are no-ops returning None, so a
    schedule is written once for every stage.
    """

    def __init__(self, *, group: dist.ProcessGroup, dtype: torch.dtype, device: torch.device):
        self.group, self.dtype, self.device = group, dtype, device
        self.stage, self.num_stages = dist.get_rank(group), dist.get_world_size(group)
        self.is_first, self.is_last = self.stage == 0, self.stage == self.num_stages - 1
        self.clock = WaitClock(device)

    def take_bubble_ms(self) -> dict[str, float]:
        """``pp_bubble_ms``: the milliseconds this stage waited on transfers since the last call."""
        return self.clock.take("pp_bubble_ms")

    def _empty(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def _exchange(self, *, send_next: Optional[torch.Tensor] = None, send_prev: Optional[torch.Tensor] = None,
                  recv_prev: Optional[tuple[int, ...]] = None,
                  recv_next: Optional[tuple[int, ...]] = None) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Post every requested transfer, wait for all; returns (from_prev, from_next)."""
        ops: list[dist.P2POp] = []
        from_prev = from_next = None
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, self._wire(send_next), group=self.group, group_peer=self.stage + 1))
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, self._wire(send_prev), group=self.group, group_peer=self.stage - 1))
        if recv_prev is not None:
            from_prev = self._empty(recv_prev)
            ops.append(dist.P2POp(dist.irecv, from_prev, group=self.group, group_peer=self.stage - 1))
        if recv_next is not None:
            from_next = self._empty(recv_next)
            ops.append(dist.P2POp(dist.irecv, from_next, group=self.group, group_peer=self.stage + 1))
        if ops:
            self.wait(dist.batch_isend_irecv(ops))
        return from_prev, from_next

    def _wire(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            raise TypeError(f"pipeline p2p carries {self.dtype}, got {x.dtype}")
        return x.detach().contiguous()

    # Any stage to any other, for schedules whose micro-batches take other routes (route_schedule). Matched in
    # order per pair and direction, as the adjacent exchanges are.

    def isend_to(self, stage: int, x: torch.Tensor) -> tuple[list[dist.Work], torch.Tensor]:
        """Post ``x`` to ``stage`` without waiting; returns the works and the tensor on the wire, which the caller
        keeps alive until it has waited on them."""
        wire = self._wire(x)
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, wire, group=self.group, group_peer=stage)]), wire

    def recv_from(self, stage: int, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor of ``shape`` from ``stage`` (waits for it)."""
        out = self._empty(shape)
        self.wait(dist.batch_isend_irecv([dist.P2POp(dist.irecv, out, group=self.group, group_peer=stage)]))
        return out

    # Around the ring, for the interleaved schedule (megatier.parallel.interleaved_schedule): activations go to
    # the next stage (the last stage's to the first, for the next model chunk), gradients to the previous. Each
    # message has its own tag, so messages are matched by what they carry, never by the order they were posted.

    def ring_isend(self, x: torch.Tensor, *, forward: bool, tag: int) -> tuple[list[dist.Work], torch.Tensor]:
        """Post ``x`` to the next stage on the ring (``forward``) or the previous one, without waiting; returns
        the works and the tensor on the wire, which the caller keeps alive until it has waited on them."""
        wire, peer = self._wire(x), (self.stage + (1 if forward else -1)) % self.num_stages
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, wire, group=self.group, group_peer=peer,
                                                  tag=tag)]), wire

    def ring_recv(self, shape: tuple[int, ...], *, forward: bool, tag: int) -> torch.Tensor:
        """The tensor tagged ``tag`` from the previous stage on the ring (``forward``: an activation) or the next
        one (a gradient); waits for it."""
        out, peer = self._empty(shape), (self.stage + (-1 if forward else 1)) % self.num_stages
        self.wait(dist.batch_isend_irecv([dist.P2POp(dist.irecv, out, group=self.group, group_peer=peer,
                                                     tag=tag)]))
        return out

    def wait(self, works: list[dist.Work]) -> None:
        """Wait for posted transfers, the time counted as this stage's bubble."""
        with self.clock.timing("pp_bubble_ms"):
            for work in works:
                work.wait()

    def recv_forward(self, shape: tuple[int, ...]) -> Optional[torch.Tensor]:
        """Activations from the previous stage (None on the first stage)."""
        if self.is_first:
            return None
        return self._exchange(recv_prev=shape)[0]

    def send_forward(self, y: torch.Tensor) -> None:
        """Activations to the next stage (no-op on the last stage)."""
        if not self.is_last:
            self._exchange(send_next=y)

    def recv_backward(self, shape: tuple[int, ...]) -> Optional[torch.Tensor]:
        """Gradient of this stage's output from the next stage (None on the last stage)."""
        if self.is_last:
            return None
        return self._exchange(recv_next=shape)[1]

    def send_backward(self, grad: Optional[torch.Tensor]) -> None:
        """Gradient of this stage's input to the previous stage (no-op on the first stage)."""
        if not self.is_first:
            self._exchange(send_prev=grad)

    def send_forward_recv_backward(self, y: torch.Tensor, shape: tuple[int, ...]) -> Optional[torch.Tensor]:
        """Steady 1F1B: ship an output forward while receiving the gradient of an earlier output."""
        if self.is_last:
            return None
        return self._exchange(send_next=y, recv_next=shape)[1]

    def send_backward_recv_forward(self, grad: Optional[torch.Tensor],
                                   shape: tuple[int, ...]) -> Optional[torch.Tensor]:
        """Steady 1F1B: ship an input gradient backward while receiving the next input."""
        if self.is_first:
            return None
        return self._exchange(send_prev=grad, recv_prev=shape)[0]
