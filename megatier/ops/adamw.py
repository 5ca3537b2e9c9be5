"""Fused AdamW over flat fp32 shards: the trainer's step and the recovery replay.

Per element (the reference in :mod:`megatier.ops.reference` spells it out)::

    p = p * (1 - lr * wd)                 # only inside decay_segments, only if wd != 0
    m = m * beta1 + (1 - beta1) * g
    v = v * beta2 + ((1 - beta2) * g) * g
    p = p + (-step_size * m) / (sqrt(v) * inv_bc2_sqrt + eps)

with ``step_size, bc2_sqrt = adamw_scalars(step, lr, beta1, beta2)`` and
``inv_bc2_sqrt = 1 / bc2_sqrt`` computed in float64 on the host and cast to float32 once.
The native :func:`adamw_replay` over N dense gradients is bitwise equal to N native
:func:`adamw_step` calls.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from megatier.ops import _native, reference
from megatier.ops.codecs import check_flat
from megatier.ops.compression import decompress_segments
from megatier.ops.records import CompressedRecord, iter_pieces
from megatier.ops.reference import adamw_scalars


def _check_state(op: str, param: Any, exp_avg: Any, exp_avg_sq: Any) -> int:
    for name, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        check_flat(t, op, name)
    n = param.numel()
    if exp_avg.numel() != n or exp_avg_sq.numel() != n:
        raise ValueError(
            f"{op}: param ({n}), exp_avg ({exp_avg.numel()}) and exp_avg_sq ({exp_avg_sq.numel()}) "
            "must have the same number of elements"
        )
    for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if t.device != param.device:
            raise ValueError(f"{op}: {name} is on {t.device} but param is on {param.device}")
    return n


def _check_hparams(op: str, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    for name, v in (("beta1", beta1), ("beta2", beta2), ("eps", eps), ("weight_decay", weight_decay)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ValueError(f"{op}: {name} must be a finite float, got {v!r}")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"{op}: beta1 and beta2 must be in [0, 1), got {beta1}, {beta2}")


def _check_decay(op: str, decay_segments: Any, n: int) -> torch.Tensor:
    if not isinstance(decay_segments, torch.Tensor):
        raise TypeError(f"{op}: decay_segments must be an int64 tensor of shape (k, 2), got "
                        f"{type(decay_segments).__name__}")
    if decay_segments.dtype != torch.int64 or not (
        decay_segments.numel() == 0 or (decay_segments.dim() == 2 and decay_segments.shape[1] == 2)
    ):
        raise ValueError(
            f"{op}: decay_segments must be an int64 tensor of shape (k, 2), got {decay_segments.dtype} "
            f"{tuple(decay_segments.shape)}"
        )
    if decay_segments.numel():
        ranges = sorted((int(a), int(b)) for a, b in decay_segments.reshape(-1, 2).tolist())
        prev_end = 0
        for a, b in ranges:
            if a < 0 or b < a or b > n:
                raise ValueError(
                    f"{op}: decay_segments must hold ranges [start, end) with 0 <= start <= end <= {n}, got [{a}, {b})"
                )
            if a < b:
                if a < prev_end:
                    raise ValueError(f"{op}: decay_segments overlap at [{a}, {min(b, prev_end)}); "
                                     "each element may be decayed at most once per step")
                prev_end = b
    return decay_segments


def adamw_step(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, step: int,
               lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               decay_segments: torch.Tensor) -> None:
    """One in-place AdamW step (decoupled weight decay) over a flat contiguous fp32 shard.

    ``decay_segments``: int64 (k, 2) shard-local half-open ranges receiving weight decay.
    """
    op = "adamw_step"
    n = _check_state(op, param, exp_avg, exp_avg_sq)
    check_flat(grad, op, "grad")
    if grad.numel() != n:
        raise ValueError(f"{op}: grad has {grad.numel()} elements but param has {n}")
    if grad.device != param.device:
        raise ValueError(f"{op}: grad is on {grad.device} but param is on {param.device}")
    _check_hparams(op, beta1, beta2, eps, weight_decay)
    _check_decay(op, decay_segments, n)
    step_size, bc2_sqrt = adamw_scalars(int(step), float(lr), beta1, beta2)
    if _native.use_native(param):
        keep = 1.0 - float(lr) * weight_decay
        _native.lib().adamw_step(param, exp_avg, exp_avg_sq, grad, step_size, bc2_sqrt, float(beta1), float(beta2),
                                 float(eps), keep, weight_decay != 0.0, decay_segments)
    else:
        reference.adamw_step(param, exp_avg, exp_avg_sq, grad, int(step), float(lr), beta1, beta2, eps,
                             weight_decay, decay_segments)


def _replay_step(op: str, i: int, g: Any, step: int, lr: float, skipped: bool, param: torch.Tensor, beta1: float,
                 beta2: float, weight_decay: float, native: bool) -> tuple[float, float, float, Any]:
    """(step size, bias correction 2 sqrt, decay keep factor, gradient spec) of replayed step ``i``."""
    if skipped:
        return 0.0, 1.0, 1.0, []
    if g is None:
        raise ValueError(f"{op}: grads[{i}] is None but step {i} is not marked skipped")
    pieces = iter_pieces(g, param.numel(), op, f"grads[{i}]")
    for piece in pieces:
        for t in piece[4:]:
            if t.numel() and t.device != param.device:
                raise ValueError(f"{op}: grads[{i}] is on {t.device} but param is on {param.device}")
    ss, bc2 = adamw_scalars(int(step), float(lr), beta1, beta2)
    return ss, bc2, 1.0 - float(lr) * weight_decay, pieces if native else g


def adamw_replay(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grads: Sequence[Optional[torch.Tensor | CompressedRecord]],
    steps: Sequence[int],
    lrs: Sequence[float],
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decay_segments: torch.Tensor,
    skipped: Optional[Sequence[bool]] = None,
) -> None:
    """N AdamW steps, in order, in one pass over the state (each element read and written once).

    ``grads[i]`` is a dense fp32 tensor or a :class:`CompressedRecord` (decoded tile by tile,
    never materialized whole); ``steps[i]`` the Adam step count and ``lrs[i]`` the learning
    rate of step i. A step with ``skipped[i]`` set (fp16 overflow) applies nothing and its
    gradient may be None. With dense gradients the result is bitwise equal to N calls of
    :func:`adamw_step`.
    """
    op = "adamw_replay"
    n = _check_state(op, param, exp_avg, exp_avg_sq)
    _check_hparams(op, beta1, beta2, eps, weight_decay)
    _check_decay(op, decay_segments, n)
    N = len(grads)
    if len(steps) != N or len(lrs) != N or (skipped is not None and len(skipped) != N):
        raise ValueError(
            f"{op}: got {N} grads, {len(steps)} steps, {len(lrs)} lrs"
            + ("" if skipped is None else f" and {len(skipped)} skipped flags")
            + "; pass one of each per replayed step"
        )
    skip = [bool(s) for s in skipped] if skipped is not None else [False] * N
    native = _native.use_native(param)
    step_sizes, bc2s, keeps, specs = [], [], [], []
    for i in range(N):
        ss, bc2, keep, spec = _replay_step(op, i, grads[i], steps[i], lrs[i], skip[i], param, beta1, beta2,
                                           weight_decay, native)
        step_sizes.append(ss)
        bc2s.append(bc2)
        keeps.append(keep)
        specs.append(spec)
    if native:
        _native.lib().adamw_replay(param, exp_avg, exp_avg_sq, specs, step_sizes, bc2s, keeps, skip, float(beta1),
                                   float(beta2), float(eps), weight_decay != 0.0, decay_segments)
        return

    def dense(g: Any):
        return (lambda: decompress_segments(g)) if isinstance(g, CompressedRecord) else g

    reference.adamw_replay(param, exp_avg, exp_avg_sq, [dense(g) for g in specs], list(steps), list(lrs), beta1, beta2,
                           eps, weight_decay, decay_segments, skip)
