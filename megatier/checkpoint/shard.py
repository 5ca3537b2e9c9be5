"""ShardAccess: the one place where the checkpoint system touches the training state.

Save side: capture a base (the optimizer shard and the scalars of its version)
and build a step's diff record from the gradient the optimizer just consumed.
Recovery side: load a base into the optimizer, replay diff batches with the
fused kernel, then publish the parameters once.

What makes the state at step s a pure function of (base V, diffs V+1..s):
the data position and the LR are functions of the step; the dropout generator
is re-seeded from (seed, step) every step by the trainer; the loss scaler's
evolution is replayed from each step's skipped flag; Adam's bias-correction
count is recorded per step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import xxhash

from megatier import ops
from megatier.checkpoint.format.payload import BaseState, DiffStep
from megatier.config import DiffStreamConfig
from megatier.ops.records import CompressedRecord


def _xxh64(t: torch.Tensor) -> int:
    return xxhash.xxh64(t.cpu().contiguous().view(torch.uint8).numpy()).intdigest()


def tiling_segments(segments, size: int) -> list[tuple[int, int]]:
    """(offset, numel) pieces covering [0, size) in order: the shard's parameter parts plus padding gaps."""
    out, pos = [], 0
    for seg in sorted(segments, key=lambda s: s.shard_offset):
        if seg.shard_offset > pos:
            out.append((pos, seg.shard_offset - pos))
        out.append((seg.shard_offset, seg.numel))
        pos = seg.shard_offset + seg.numel
    if pos < size:
        out.append((pos, size - pos))
    return [p for p in out if p[1] > 0]


@dataclass
class ShardAccess:
    """Reads and writes one rank's optimizer shard (a DistributedAdamW) for the checkpoint system."""

    optimizer: object  # DistributedAdamW: master, exp_avg, exp_avg_sq, last_grad, last_lr, ...
    global_batch_size: int
    # Error feedback of a lossy diff stream: what the records since the last base left out of the gradients
    # (shape of the shard, fp32, on the gradient's device; None until the first lossy record).
    residual: Optional[torch.Tensor] = field(default=None, init=False, repr=False)
    _residual_zero: bool = field(default=False, init=False, repr=False)  # a base since the last add: it is zero
    # The step since which the state is not exact: a last-resort recovery (CheckFree) rebuilt a pipeline stage
    # there. Kept in every base, so a later restore still knows.
    inexact_since: Optional[int] = field(default=None, init=False)
    # The step this rank's in-memory state is known to be at, set by an in-process recovery before it restores:
    # a rank already at the agreed end reads nothing (None: unknown, e.g. the failure came mid-update).
    live_version: Optional[int] = field(default=None, init=False)
    # The step a launch with nothing to restore starts at: 0, or the iteration of a job imported from another
    # framework (model.init_from, megatier.training.job_import), whose state the shard already holds.
    start_step: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        o = self.optimizer
        self.segments = tiling_segments(o.shard_segments, o.master.numel())

    @property
    def numel(self) -> int:
        return self.optimizer.master.numel()

    @property
    def grad_sumsq(self) -> Optional[float]:
        """This rank's part of the squared gradient norm of the step the state is at (None: not known)."""
        sumsq = self.optimizer.last_sumsq
        return None if sumsq is None else float(sumsq)

    def set_grad_sumsq(self, value: Optional[float]) -> None:
        self.optimizer.last_sumsq = None if value is None else torch.tensor(value, dtype=torch.float64)

    @property
    def nbytes(self) -> int:
        """Bytes of the full fp32 shard state (master + both moments): a base's tensor payload."""
        return 3 * 4 * self.numel

    # ---- save side ------------------------------------------------------------------------

    def capture_base(self, version: int, snapshot: bool = True) -> BaseState:
        """The shard at ``version``; ``snapshot`` copies the tensors so training may go on meanwhile."""
        o = self.optimizer
        take = (lambda t: t.detach().to("cpu", copy=True)) if snapshot else (lambda t: t.detach().cpu())
        return self.base_of(version, {k: take(getattr(o, k)) for k in ("master", "exp_avg", "exp_avg_sq")})

    def base_of(self, version: int, tensors: dict[str, torch.Tensor]) -> BaseState:
        """The base of ``version`` from its state ``tensors`` (a snapshot, or parts reconciled to ``version``)
        and the scalars the optimizer has now, which must be those of ``version``.

        A replay starts from a base, so the error feedback starts afresh at each one (see :meth:`compress`).
        """
        self._residual_zero = True
        o = self.optimizer
        scaler = o.scaler.state_dict() if o.scaler is not None else None
        return BaseState(
            version=version, adam_steps=o.adam_steps,
            master=tensors["master"], exp_avg=tensors["exp_avg"], exp_avg_sq=tensors["exp_avg_sq"],
            schedule=o.schedule.state_dict(), loss_scaler=scaler,
            data_position={"step": version, "consumed_samples": o.schedule.samples_after(version)},
            rng={"torch_cpu": torch.get_rng_state()},
            segments=[s.to_dict() for s in o.shard_segments],
            grad_sumsq=self.grad_sumsq, lr_scale=o.lr_scale, inexact_since=self.inexact_since,
        )

    def consumed(self) -> tuple[Optional[torch.Tensor], float, int, bool]:
        """(gradient, lr, adam step count, skipped) of the step just taken.

        The gradient is the fresh shard tensor the optimizer consumed and will not
        modify again, so handing it to another thread needs no copy.
        """
        o = self.optimizer
        return (None if o.last_skipped else o.last_grad.detach()), o.last_lr, o.adam_steps, o.last_skipped

    def compress(self, step: int, grad: Optional[torch.Tensor], lr: float, adam_step: int, skipped: bool,
                 cfg: DiffStreamConfig) -> tuple[DiffStep, int]:
        """One step's diff record from :meth:`consumed`'s values; returns it and its tensor bytes.

        Compresses where the gradient lives; on a GPU without waiting for it until
        the record (~1% of the gradient's size) is copied to the host in one
        transfer (:mod:`megatier.ops.batched`).

        A lossy codec compresses the gradient plus the residual, what the records
        since the last base left out, and keeps the new residual (error feedback):
        the replayed records then sum to the true gradients since the base up to
        one residual, so a long chain does not drift. Lossless fp32 needs none.
        """
        if skipped:
            # Nothing was applied (fp16 overflow); the flag alone replays it, including the scaler update.
            return DiffStep(step, lr, adam_step, True, {}, {}), 0
        lossy = cfg.compression != "fp32"
        addend = None
        with ops.thread_parallelism(cfg.threads if grad.device.type == "cpu" else 0):
            if lossy:
                grad, addend = self._residual_plus(grad)
            record = ops.compress_segments(grad, self.segments, cfg.compression, cfg.topk_ratio, cfg.small_threshold,
                                           seed=step, feedback=lossy, addend=addend)  # residual: what it left out
        tensors = {k: v.contiguous() for k, v in record.tensors.items()}
        return DiffStep(step, lr, adam_step, False, tensors, record.header, self.grad_sumsq), record.nbytes

    def _residual_plus(self, grad: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The residual and what to add to it before compressing: ``grad``, which the compression folds into its
        own pass over the residual (one read of it fewer than ``residual.add_(grad)``), leaving the sum as the
        new residual. After a base the residual is zero, and rather than clearing it in the base's step it is
        overwritten here with ``grad + 0.0``: bitwise ``0.0 + grad`` (IEEE addition commutes, signed zeros and
        NaNs included) in one pass instead of two."""
        if self.residual is None:
            self.residual, self._residual_zero = torch.add(grad, 0.0), False
            return self.residual, None
        if self._residual_zero:
            torch.add(grad, 0.0, out=self.residual)
            self._residual_zero = False
            return self.residual, None
        return self.residual, grad

    # ---- recovery side --------------------------------------------------------------------

    def load_base(self, base: BaseState) -> None:
        """Overwrite the shard with ``base`` (tensors, Adam count, loss scaler, CheckFree's scalars); parameters
        come later."""
        tensors = {name: getattr(base, name) for name in ("master", "exp_avg", "exp_avg_sq")}
        self.load_state(tensors, base.adam_steps, base.loss_scaler, f"base v{base.version}")
        self.optimizer.lr_scale = base.lr_scale
        self.set_grad_sumsq(base.grad_sumsq)
        self.inexact_since = base.inexact_since

    def follow_schedule(self, recorded: dict[str, str]) -> None:
        """The LR schedule with the job's recorded values of its followed keys (fingerprint key -> JSON)."""
        self.optimizer.schedule = self.optimizer.schedule.following(recorded)

    def load_state(self, tensors: dict[str, torch.Tensor], adam_steps: int, loss_scaler: Optional[dict],
                   what: str) -> None:
        """Overwrite the shard's tensors (``master``, ``exp_avg``, ``exp_avg_sq``), Adam count and loss scaler;
        ``what`` names the source in errors."""
        o = self.optimizer
        for name, src in tensors.items():
            dst = getattr(o, name)
            if src.shape != dst.shape:
                raise ValueError(f"{what} has {name} of shape {tuple(src.shape)}, this rank's shard is "
                                 f"{tuple(dst.shape)}; the checkpoint was written for another model or layout")
            dst.copy_(src)
        o.adam_steps = adam_steps
        if o.scaler is not None:
            if loss_scaler is None:
                raise ValueError(f"{what} has no loss-scaler state but this run uses fp16; "
                                 f"resume with the precision the checkpoint was written with")
            o.scaler.load_state_dict(loss_scaler)

    def replay(self, steps: Sequence[DiffStep]) -> None:
        """Apply consecutive diff steps with one fused ``adamw_replay`` pass (one batch per call)."""
        o = self.optimizer
        device = o.master.device  # a tier hands records over in host memory; the state may live on a GPU
        grads: list[Optional[CompressedRecord]] = [
            None if s.skipped else CompressedRecord(dict(s.header), {k: t.to(device) for k, t in s.tensors.items()})
            for s in steps]
        c = o.cfg
        ops.adamw_replay(o.master, o.exp_avg, o.exp_avg_sq, grads, [s.adam_step for s in steps],
                         [s.lr for s in steps], c.beta1, c.beta2, c.eps, c.weight_decay, o.decay_ranges,
                         skipped=[s.skipped for s in steps])
        if steps:
            o.adam_steps = steps[-1].adam_step
            self.set_grad_sumsq(steps[-1].grad_sumsq)
        if o.scaler is not None:
            for s in steps:
                o.scaler.update(s.skipped)

    def replica_digests(self) -> list[tuple[int, int]]:
        """(global rank, xxh64 of the published parameters' bytes) for every data-parallel replica of this
        shard's parameters, which must all be equal after the all-gather (collective over the dp group;
        :mod:`.policy.replicas`).

        Under expert parallelism the dp ranks hold different experts: a rank's digest is that of its dense
        parameters and of the experts of its whole ep group (the dp ranks with its expert-dp rank, which
        together hold every expert), so it equals those of the ranks holding the same parameters, and a
        corrupted expert makes its ep group differ from the other groups."""
        o = self.optimizer
        getattr(o, "wait_params", lambda: None)()  # a bucketed gather in flight (parallel.overlap_param_gather)
        params = o.param_flat.detach()
        dense = getattr(o.layout, "dense_numel", params.numel())
        digests = [_xxh64(params[:dense]), _xxh64(params[dense:])]
        rank = dist.get_rank() if dist.is_initialized() else 0
        group = o.dp_group
        if group is None or dist.get_world_size(group) == 1:
            return [(rank, digests[0] ^ digests[1])]
        mine = torch.tensor([rank] + [d - (1 << 63) for d in digests], dtype=torch.int64, device=params.device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, mine, group=group)
        rows = [[int(v) for v in t.tolist()] for t in every]
        edp = getattr(o.layout, "edp", len(rows))
        return [(r[0], xxhash.xxh64(repr([r[1]] + [q[2] for q in rows[i % edp::edp]]).encode()).intdigest())
                for i, r in enumerate(rows)]

    def publish(self) -> None:
        """After loading and replaying: copy master into the model parameters on every dp rank."""
        self.optimizer.publish_params()
