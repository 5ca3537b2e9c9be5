"""The interleaved 1F1B schedule that runs (``parallel.virtual_stages`` > 1).

Each rank runs its order of forwards and backwards per model chunk
(:func:`megatier.parallel.interleaved.interleaved_order`). Chunk c of rank p is
virtual stage c * P + p: its output goes to virtual stage c * P + p + 1 (rank
p + 1, same chunk; from the last rank to rank 0, chunk c + 1) and its input
gradient back the same way, around the ring of the pipeline group
(:meth:`PipelineComm.ring_isend` / :meth:`PipelineComm.ring_recv`).

Sends are posted without waiting and receives wait, each message tagged with
the virtual stage that receives it, its micro-batch and its direction, so
which message a receive takes never depends on the order messages were
posted: a rank blocks only on the data its next op needs, which the order
guarantees an earlier op elsewhere produces. The sends are waited on at the
end of the step. All waits count as the stage's bubble (``pp_bubble_ms``).

The loss contract is :mod:`megatier.parallel.schedules`'s: each micro-batch
contributes ``mean per-token loss / n``; the last virtual stage returns the
loss, the others their router side losses. For one chunk the backwards run in
micro-batch order, so every parameter folds its gradients in the order plain
1F1B does.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from megatier.parallel.interleaved import Op, interleaved_order
from megatier.parallel.p2p import PipelineComm
from megatier.parallel.schedules import Microbatches, activation_shape


class _Chunks:
    """One step's state on this rank: the stored forwards and the sends in flight."""

    def __init__(self, model: nn.Module, microbatches: Microbatches, comm: PipelineComm, *, virtual_stages: int,
                 hidden_size: int, seq_shards: int):
        self.model, self.microbatches, self.comm, self.v = model, microbatches, comm, virtual_stages
        self.n = len(microbatches)
        self.shapes = [activation_shape(tokens, hidden_size, seq_shards) for tokens, _ in microbatches]
        self.total = torch.zeros((), dtype=torch.float32)
        self.stored: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]] = {}
        self.sending: list[tuple[list[dist.Work], torch.Tensor]] = []

    def _virtual(self, chunk: int) -> int:
        return chunk * self.comm.num_stages + self.comm.stage

    def _tag(self, virtual_stage: int, microbatch: int, forward: bool) -> int:
        """The tag of the message virtual stage ``virtual_stage`` receives for ``microbatch``."""
        return 1 + 2 * (virtual_stage * self.n + microbatch) + (0 if forward else 1)

    def forward(self, op: Op) -> None:
        vs, (tokens, labels) = self._virtual(op.chunk), self.microbatches[op.microbatch]
        last = vs == self.comm.num_stages * self.v - 1
        if vs == 0:
            x = tokens
        else:
            x = self.comm.ring_recv(self.shapes[op.microbatch], forward=True, tag=self._tag(vs, op.microbatch, True))
            x.requires_grad_(torch.is_grad_enabled())
        if last:
            y, side = self.model.run_chunk(op.chunk, x, labels).float().mean() / self.n, None
            self.total += y.detach().cpu()
        else:
            y = self.model.run_chunk(op.chunk, x)
            side = self.model.side_loss()
            side = None if side is None else side.float() / self.n
            if side is not None:
                self.total += side.detach().cpu()
            self.sending.append(self.comm.ring_isend(y, forward=True, tag=self._tag(vs + 1, op.microbatch, True)))
        if torch.is_grad_enabled():
            self.stored[(op.chunk, op.microbatch)] = (x, y, side)

    def backward(self, op: Op, loss_scale: float) -> None:
        vs = self._virtual(op.chunk)
        x, y, side = self.stored.pop((op.chunk, op.microbatch))
        if vs == self.comm.num_stages * self.v - 1:
            (y * loss_scale).backward()
        else:
            grad_y = self.comm.ring_recv(self.shapes[op.microbatch], forward=False,
                                         tag=self._tag(vs, op.microbatch, False))
            if side is None:
                torch.autograd.backward(y, grad_tensors=grad_y)
            else:
                torch.autograd.backward([y, side * loss_scale], grad_tensors=[grad_y, None])
        if vs > 0:
            self.sending.append(self.comm.ring_isend(x.grad, forward=False,
                                                     tag=self._tag(vs - 1, op.microbatch, False)))

    def finish(self) -> torch.Tensor:
        """Wait for the sends still in flight; the rank's loss contribution."""
        for works, _wire in self.sending:
            self.comm.wait(works)
        self.sending.clear()
        return self.total


def forward_backward_interleaved(model: nn.Module, microbatches: Microbatches, *, comm: PipelineComm,
                                 virtual_stages: int, hidden_size: int, loss_scale: float,
                                 seq_shards: int = 1) -> torch.Tensor:
    """pp > 1, v model chunks per rank: the interleaved 1F1B step (see the module docstring)."""
    step = _Chunks(model, microbatches, comm, virtual_stages=virtual_stages, hidden_size=hidden_size,
                   seq_shards=seq_shards)
    for op in interleaved_order(pp=comm.num_stages, rank=comm.stage, virtual_stages=virtual_stages,
                                num_microbatches=len(microbatches)):
        if op.kind == "F":
            step.forward(op)
        else:
            step.backward(op, loss_scale)
    return step.finish()


@torch.no_grad()
def forward_interleaved(model: nn.Module, microbatches: Microbatches, *, comm: PipelineComm, virtual_stages: int,
                        hidden_size: int, seq_shards: int = 1) -> torch.Tensor:
    """Evaluation: each micro-batch through every chunk in turn, no backward. Any number of micro-batches (the
    training order needs a multiple of pp); a rank waits only for lower virtual stages of the same micro-batch."""
    step = _Chunks(model, microbatches, comm, virtual_stages=virtual_stages, hidden_size=hidden_size,
                   seq_shards=seq_shards)
    for m in range(len(microbatches)):
        for chunk in range(virtual_stages):
            step.forward(Op("F", chunk, m))
    total = step.finish()
    comm.take_bubble_ms()  # evaluation's waits are no training step's bubble
    return total


def run_interleaved(model: nn.Module, microbatches: Microbatches, *, comm: PipelineComm, virtual_stages: int,
                    hidden_size: int, loss_scale: float, forward_only: bool = False,
                    seq_shards: int = 1) -> torch.Tensor:
    """The training step (:func:`forward_backward_interleaved`), or evaluation's forwards with ``forward_only``."""
    if forward_only:
        return forward_interleaved(model, microbatches, comm=comm, virtual_stages=virtual_stages,
                                   hidden_size=hidden_size, seq_shards=seq_shards)
    return forward_backward_interleaved(model, microbatches, comm=comm, virtual_stages=virtual_stages,
                                        hidden_size=hidden_size, loss_scale=loss_scale, seq_shards=seq_shards)
