"""A training step seen as operations, and the copier that moves base chunks during them.

:class:`StepOps` hooks this rank's model: an *event* is the end of a leaf
module's forward or the start of its backward (a hook on the gradient of its
output), and the optimizer's update closes the step. Op t runs from event t to
event t + 1. Events are numbered from 0 in every training step (evaluation, in
``no_grad``, has none), so a schedule made from one profiled step names the
same operations in every later step of the same layout. With no listener set a
hook costs one attribute check.

:class:`Profiler` is a listener that turns one step into an
:class:`~.schedule.OpProfile`: op durations, and the memory the step holds
during each op. On CUDA that is ``torch.cuda.memory_allocated``; on CPU, where
the allocator keeps no such count, it is modeled as the activations alive:
each module output counted from its forward to the start of its backward.

:class:`Copier` runs the copies off the training thread: on CPU a helper
thread (``copy_`` releases the GIL, so it overlaps the operation it was issued
in), on CUDA a side stream into pinned host memory; host-side work (writing a
finished part to node memory) goes to the same thread, in order. ``wait``
returns when everything issued is complete; the update must not start before
that. The one-time work of planning (measuring the copy bandwidth, solving the
schedule) runs on that thread too, while the loop trains.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional, Protocol

import torch
from torch import nn

from megatier.checkpoint.save.schedule import CaptureSchedule, Chunk, OpProfile
from megatier.checkpoint.threads import demote_current_thread


class OpListener(Protocol):
    def on_event(self, index: int, name: str, delta_bytes: int) -> None:
        """Event ``index`` of the step (op ``index`` starts); ``delta_bytes``: activation bytes it adds (> 0) or
        frees (< 0)."""

    def on_update(self) -> None:
        """The step's update is about to change the optimizer state: the last op has ended."""


def leaf_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules without children: the operations a step is profiled into."""
    return [(name, m) for name, m in model.named_modules() if name and not any(True for _ in m.children())]


class StepOps:
    """Hooks on ``model``'s leaf modules and ``optimizer``'s update; events go to ``listener`` when set."""

    def __init__(self, model: nn.Module, optimizer):
        self.listener: Optional[OpListener] = None
        self._event = 0
        self._handles = [m.register_forward_hook(self._forward_hook(name)) for name, m in leaf_modules(model)]
        optimizer.register_pre_step_hook(self._update)

    def _forward_hook(self, name: str):
        def hook(module: nn.Module, inputs, output) -> None:
            if self.listener is None or not module.training or not torch.is_grad_enabled():
                return
            if not isinstance(output, torch.Tensor) or any(output is x for x in inputs):
                return  # a module that returned its input (dropout at p = 0) did no operation of its own
            size = output.numel() * output.element_size()
            self._emit(f"fwd {name}", size)
            if output.requires_grad:
                output.register_hook(lambda grad: self._emit(f"bwd {name}", -size))
        return hook

    def _emit(self, name: str, delta: int) -> None:
        listener = self.listener
        if listener is not None:
            listener.on_event(self._event, name, delta)
        self._event += 1

    def _update(self, iteration: int) -> None:
        self._event = 0
        if self.listener is not None:
            self.listener.on_update()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.listener = None


class Profiler:
    """A listener that records one step; :attr:`profile` is set once the step's update closes it."""

    def __init__(self, device: torch.device):
        self.device = device
        self._names: list[str] = []
        self._times: list[float] = []
        self._live: list[int] = []
        self._activations = 0
        self.profile: Optional[OpProfile] = None

    def _memory(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return self._activations

    def on_event(self, index: int, name: str, delta_bytes: int) -> None:
        self._activations += delta_bytes
        self._names.append(name)
        self._times.append(time.perf_counter())
        self._live.append(self._memory())

    def on_update(self) -> None:
        if self.profile is not None or not self._names:
            return
        ends = self._times[1:] + [time.perf_counter()]
        self.profile = OpProfile(tuple(self._names), tuple(e - s for s, e in zip(self._times, ends)),
                                 tuple(self._live))


def _run_into(future: Future, work: Callable[[], object]) -> None:
    """``work``'s result (or exception) into ``future``: a call given while the copier was held."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(work())
    except BaseException as e:  # the caller sees it from the future, as from a submitted call
        future.set_exception(e)


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for src, dst in pairs:
        dst.copy_(src)


class Copier:
    """Copies (source, destination) pairs off the training thread; see the module docstring."""

    def __init__(self, device: torch.device):
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # The copies themselves on CPU, and on both the host-side work (staging a finished part) in order.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="megatier-capture", initializer=demote_current_thread)
        self._pending: list[Future] = []
        self._inflight: list = []  # CUDA: the tensors of copies not yet waited for (their memory must not be reused)
        self._held: Optional[list[tuple[Future, Callable[[], object]]]] = None  # given while held, not yet started

    def host_buffer(self, numel: int) -> torch.Tensor:
        """Where a chunk lands: host memory (pinned on CUDA, so the copy is asynchronous)."""
        return torch.empty(numel, dtype=torch.float32, pin_memory=self._stream is not None)

    def submit(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if not pairs:
            return
        if self._stream is None:
            self.call(lambda: _copy_all(pairs))
            return
        self._issue_on_stream(pairs)
        self._inflight.append(pairs)

    def call(self, work: Callable[[], object]) -> Future:
        """Run ``work`` on the copier's thread after what was given to it before; :meth:`wait` waits for it too."""
        if self._held is not None:
            future: Future = Future()
            self._held.append((future, work))
        else:
            future = self._pool.submit(work)
        self._pending.append(future)
        return future

    def hold(self) -> None:
        """Start nothing until :meth:`release`: the loop's save path wakes its helper threads last (a woken
        helper takes the GIL whenever the loop lets go of it, and keeps it for up to the switch interval)."""
        if self._held is None:
            self._held = []

    def release(self) -> None:
        """Start, in order, what was given since :meth:`hold`."""
        held, self._held = self._held, None
        for future, work in held or ():
            self._pool.submit(_run_into, future, work)

    def copy_now(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy in the calling thread (on CUDA on the copier's stream, waited for): what :meth:`submit` has the
        copier do, for timing it from the copier's own thread."""
        if self._stream is None:
            _copy_all(pairs)
            return
        self._issue_on_stream(pairs)
        self._stream.synchronize()

    def _issue_on_stream(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """CUDA: the copies on the side stream, after what the calling thread's stream has queued (the last
        update, or whatever wrote the sources)."""
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            for src, dst in pairs:
                dst.copy_(src, non_blocking=True)

    def wait(self) -> None:
        """Every copy and call issued so far is complete (the sources may change, the destinations be read)."""
        self.release()
        if self._stream is not None:
            self._stream.synchronize()
            self._inflight = []
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)


def copy_bandwidth(copier: Copier, *, nbytes: int = 16 << 20, repeats: int = 3) -> float:
    """Bytes per second the copier moves from its device's memory to host memory: the best of ``repeats`` copies
    of ``nbytes``. Called on the copier's thread while the loop trains (:meth:`Copier.call`), it measures what
    a scheduled copy gets: one thread (or the side stream) sharing the machine with the training step."""
    n = nbytes // 4
    src = torch.zeros(n, dtype=torch.float32, device=copier.device)
    dst = copier.host_buffer(n)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        copier.copy_now([(src, dst)])
        best = min(best, time.perf_counter() - start)
    return nbytes / max(best, 1e-9)


class ScheduledCopy:
    """A listener that copies one range of the optimizer state during the operations its schedule names.

    ``sources``: kind -> the live (hi - lo,) view of the shard. Chunks run at their op's event; whatever has not
    run by the update (an op that did not occur) runs there, and the update waits for every copy: the range
    in :attr:`destination` is the state before that update, whatever the hooks saw.
    """

    def __init__(self, sources: dict[str, torch.Tensor], schedule: CaptureSchedule, copier: Copier):
        self.sources, self.copier = sources, copier
        # Allocated at the first copy (in the step that copies it), by when the copier thread has staged the
        # part before it: the process holds one part at a time.
        self.destination: Optional[dict[str, torch.Tensor]] = None
        self._by_op: dict[int, list[Chunk]] = {}
        for chunk, op in zip(schedule.chunks, schedule.ops):
            self._by_op.setdefault(op, []).append(chunk)
        self.done = False

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() * 4 for t in self.destination.values()) if self.destination is not None else 0

    def _copy(self, chunks: list[Chunk]) -> None:
        if self.destination is None:
            self.destination = {k: self.copier.host_buffer(src.numel()) for k, src in self.sources.items()}
        self.copier.submit([(src[c.lo:c.hi], self.destination[k][c.lo:c.hi])
                            for c in chunks for k, src in self.sources.items()])

    def on_event(self, index: int, name: str, delta_bytes: int) -> None:
        chunks = self._by_op.pop(index, None)
        if chunks:
            self._copy(chunks)

    def on_update(self) -> None:
        self.finish()

    def finish(self) -> None:
        """Copy what is left and wait for every copy of this range."""
        if self.done:
            return
        self._copy([c for chunks in self._by_op.values() for c in chunks])
        self._by_op = {}
        self.copier.wait()
        self.done = True
