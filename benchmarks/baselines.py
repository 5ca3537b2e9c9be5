"""Baseline checkpointers for the overhead benchmark (benchmarks/bench_overhead.py).

Each one plugs into the Trainer exactly like the tiered CheckpointManager (the
Checkpointer protocol, injected with ``Trainer(cfg, checkpointer=factory)``):
``restore() -> (0, None)`` (baselines are only measured, never resumed),
``after_step(step) -> dict`` (merged into the step's metrics record; the trainer
times the call as ``ckpt_stall_ms``) and ``close()`` (drains what is in flight).

What they save is one rank's full training state, as its own framework would:

* the model's ``state_dict`` (this rank's tp/pp slice; tied weights once),
* the ZeRO-1 optimizer shard: fp32 ``master``, ``exp_avg``, ``exp_avg_sq``,
* the scalars ``step`` and ``adam_steps``.

The rows of the benchmark, after the section 5 baselines of TierCheck (arXiv:2605.17821):

* :class:`SyncTorchSave` - Megatron-LM's default: every K steps a synchronous
  ``torch.save`` of the full state to ``<dir>/iter_<step>/rank<r>.pt`` (temp file +
  ``os.replace``), then a ``latest_checkpointed_iteration.txt`` tracker.
* :class:`DcpAsyncSave` - ``torch.distributed.checkpoint.async_save`` every K steps
  with its default (thread) executor and default stager; the previous save's
  future is awaited before the next one starts, as the DCP docs recommend.
* :class:`InMemoryEveryStep` - Gemini-style: every step a full copy of the state
  into preallocated host buffers (pinned when CUDA is present).
* :class:`SnapshotThenPersist` - CheckFreq-style: every K steps a snapshot into
  preallocated host buffers inside the loop, then ``torch.save`` of the snapshot
  by a background thread; the next snapshot first waits for that persist.

Each reports the tensor bytes of one checkpoint (``bytes_per_checkpoint``) and,
for the ones that write files, the bytes on disk of one checkpoint
(``disk_bytes_per_checkpoint``: this rank's file; for DCP, which writes one
directory for all ranks and stores dp-replicated model tensors once, the
directory's size over the world size, known on rank 0 after ``close``). Per
step they return ``ckpt_bytes`` (bytes checkpointed at this
step, 0 between checkpoints) and ``ckpt_wait_ms`` (time spent waiting for the
previous asynchronous checkpoint inside the call).
"""
from __future__ import annotations

import os
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

TRACKER = "latest_checkpointed_iteration.txt"
OPTIM_KEYS = ("master", "exp_avg", "exp_avg_sq")


def iter_dir(root: str, step: int) -> str:
    """Megatron's layout: one directory per saved iteration."""
    return os.path.join(root, f"iter_{step:07d}")


def rank_file(root: str, step: int, rank: int) -> str:
    return os.path.join(iter_dir(root, step), f"rank{rank:05d}.pt")


def model_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state_dict tensors, detached; a tensor shared under two names (tied weights) counted once."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, t in model.state_dict(keep_vars=False).items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach()
    return out


def full_state(optimizer, model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of one rank's training state, flat-named: ``model/<name>`` and ``optim/<name>``."""
    out = {f"model/{k}": v for k, v in model_tensors(model).items()}
    for k in OPTIM_KEYS:
        out[f"optim/{k}"] = getattr(optimizer, k).detach()
    return out


def tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _host_buffers(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    pin = torch.cuda.is_available()
    return {k: torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin) for k, t in tensors.items()}


def _copy_into(buffers: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None:
    on_gpu = False
    for k, t in tensors.items():
        buffers[k].copy_(t, non_blocking=t.is_cuda)
        on_gpu |= t.is_cuda
    if on_gpu:
        torch.cuda.synchronize()


def _atomic_torch_save(obj, path: str) -> int:
    """torch.save to a temp name then os.replace (no fsync, like Megatron); returns the file size."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)
    return os.path.getsize(path)


def _dir_bytes(path: str) -> int:
    total = 0
    for base, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(base, f))
    return total


class _Baseline:
    """Shared bookkeeping: what one checkpoint holds and how many were taken."""

    name = "baseline"

    def __init__(self, optimizer, model: nn.Module):
        self.optimizer = optimizer
        self.model = model
        self.state = full_state(optimizer, model)  # live views; their storage never changes
        self.bytes_per_checkpoint = tensor_bytes(self.state)
        self.checkpoints: list[int] = []
        self.disk_bytes: list[int] = []

    @property
    def disk_bytes_per_checkpoint(self) -> Optional[float]:
        return sum(self.disk_bytes) / len(self.disk_bytes) if self.disk_bytes else None

    def restore(self) -> tuple[int, None]:
        return 0, None

    def _scalars(self, step: int) -> dict:
        return {"step": step, "adam_steps": self.optimizer.adam_steps}

    def summary(self) -> dict:
        return {"name": self.name, "checkpoints": len(self.checkpoints),
                "bytes_per_checkpoint": self.bytes_per_checkpoint,
                "disk_bytes_per_checkpoint": self.disk_bytes_per_checkpoint}

    def close(self, *, failed: bool = False) -> None:
        pass


class SyncTorchSave(_Baseline):
    """Megatron-style: every ``interval`` steps a blocking torch.save of the full state to ``directory``."""

    name = "sync_torch_save"

    def __init__(self, optimizer, model: nn.Module, directory: str, interval: int, *, rank: int = 0,
                 group: Optional[dist.ProcessGroup] = None):
        super().__init__(optimizer, model)
        if interval < 1:
            raise ValueError(f"interval={interval} must be >= 1")
        self.directory, self.interval, self.rank, self.group = directory, interval, rank, group

    def after_step(self, step: int) -> dict:
        if step % self.interval:
            return {"ckpt_bytes": 0}
        obj = {"model": {k[len("model/"):]: v for k, v in self.state.items() if k.startswith("model/")},
               "optimizer": {k: self.state[f"optim/{k}"] for k in OPTIM_KEYS}, **self._scalars(step)}
        self.disk_bytes.append(_atomic_torch_save(obj, rank_file(self.directory, step, self.rank)))
        # Megatron: every rank has saved, then rank 0 moves the tracker.
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.barrier(group=self.group)
        if self.rank == 0:
            tracker = os.path.join(self.directory, TRACKER)
            with open(tracker + ".tmp", "w") as f:
                f.write(str(step))
            os.replace(tracker + ".tmp", tracker)
        self.checkpoints.append(step)
        return {"ckpt_bytes": self.bytes_per_checkpoint}


class DcpAsyncSave(_Baseline):
    """torch.distributed.checkpoint.async_save every ``interval`` steps to ``<directory>/iter_<step>``.

    Keys name what a tensor is so DCP's planner treats it correctly: the model
    slice is keyed by its (pp, tp) coordinates, so dp replicas are deduplicated
    (written by one rank), and the optimizer shard by (pp, tp, dp), so every
    rank writes its own.
    """

    name = "dcp_async_save"

    def __init__(self, optimizer, model: nn.Module, directory: str, interval: int, *, rank: int = 0,
                 process_group: Optional[dist.ProcessGroup] = None, coords: tuple[int, int, int] = (0, 0, 0)):
        super().__init__(optimizer, model)
        if interval < 1:
            raise ValueError(f"interval={interval} must be >= 1")
        self.directory, self.interval, self.rank, self.group = directory, interval, rank, process_group
        pp, tp, dp = coords
        self.keyed = {}
        for k, v in self.state.items():
            kind, name = k.split("/", 1)
            prefix = f"model.pp{pp}.tp{tp}" if kind == "model" else f"optim.pp{pp}.tp{tp}.dp{dp}"
            self.keyed[f"{prefix}.{name}"] = v
        self._future = None
        import torch.distributed.checkpoint as dcp  # imported here, not timed inside the first save

        self._dcp = dcp

    def _wait(self) -> float:
        if self._future is None:
            return 0.0
        t0 = time.perf_counter()
        self._future.result()  # re-raises a failed save
        self._future = None
        return time.perf_counter() - t0

    def after_step(self, step: int) -> dict:
        if step % self.interval:
            return {"ckpt_bytes": 0}
        waited = self._wait()
        # Scalars are replicated on every rank: DCP writes them once.
        state = {**self.keyed, "step": step, "adam_steps": self.optimizer.adam_steps}
        # sync_files=False: no fsync, like the other rows (DCP's default writer fsyncs every file).
        writer = self._dcp.FileSystemWriter(iter_dir(self.directory, step), sync_files=False)
        self._future = self._dcp.async_save(state, storage_writer=writer, process_group=self.group)
        self.checkpoints.append(step)
        return {"ckpt_bytes": self.bytes_per_checkpoint, "ckpt_wait_ms": 1000.0 * waited}

    def close(self, *, failed: bool = False) -> None:
        self._wait()
        # Every rank's files of the last save exist once its future resolved on every rank.
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.barrier(group=self.group)
        if self.rank == 0:
            # Per rank on average, like the others' figures (DCP writes one directory for all ranks).
            world = dist.get_world_size(self.group) if self.group is not None else 1
            self.disk_bytes = [_dir_bytes(iter_dir(self.directory, s)) // world for s in self.checkpoints]


class InMemoryEveryStep(_Baseline):
    """Gemini-style: every step a full copy of the state into preallocated host memory."""

    name = "in_memory_every_step"

    def __init__(self, optimizer, model: nn.Module):
        super().__init__(optimizer, model)
        self.buffers = _host_buffers(self.state)
        self.version: Optional[dict] = None

    def after_step(self, step: int) -> dict:
        _copy_into(self.buffers, self.state)
        self.version = self._scalars(step)
        self.checkpoints.append(step)
        return {"ckpt_bytes": self.bytes_per_checkpoint}


class SnapshotThenPersist(_Baseline):
    """CheckFreq-style: snapshot to host buffers every ``interval`` steps, persist them in a background thread."""

    name = "snapshot_then_persist"

    def __init__(self, optimizer, model: nn.Module, directory: str, interval: int, *, rank: int = 0):
        super().__init__(optimizer, model)
        if interval < 1:
            raise ValueError(f"interval={interval} must be >= 1")
        self.directory, self.interval, self.rank = directory, interval, rank
        self.buffers = _host_buffers(self.state)
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def _persist(self, step: int, scalars: dict) -> None:
        try:
            obj = {"model": {k[len("model/"):]: v for k, v in self.buffers.items() if k.startswith("model/")},
                   "optimizer": {k: self.buffers[f"optim/{k}"] for k in OPTIM_KEYS}, **scalars}
            self.disk_bytes.append(_atomic_torch_save(obj, rank_file(self.directory, step, self.rank)))
        except BaseException as e:  # surfaced on the training thread at the next wait
            self._error = e

    def _wait(self) -> float:
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"{self.name}: background persist failed: {error}") from error
        return time.perf_counter() - t0

    def after_step(self, step: int) -> dict:
        if step % self.interval:
            return {"ckpt_bytes": 0}
        waited = self._wait()  # the buffers are reused: the previous persist must be done
        _copy_into(self.buffers, self.state)
        self._thread = threading.Thread(target=self._persist, args=(step, self._scalars(step)),
                                        name=f"persist-{step}", daemon=True)
        self._thread.start()
        self.checkpoints.append(step)
        return {"ckpt_bytes": self.bytes_per_checkpoint, "ckpt_wait_ms": 1000.0 * waited}

    def close(self, *, failed: bool = False) -> None:
        self._wait()
