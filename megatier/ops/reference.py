"""Pure-torch reference implementations of MegaTier's native ops.

These define the semantics that the compiled kernels in ``megatier/csrc`` must
reproduce. They are also the fallback when the extension is not built.
"""
from __future__ import annotations

import math

import torch


def adamw_scalars(step: int, lr: float, beta1: float, beta2: float) -> tuple[float, float]:
    """Host-side scalars of one AdamW step, computed in float64.

    Returns ``(step_size, bias_correction2_sqrt)`` where
    ``step_size = lr / (1 - beta1**step)`` and ``bias_correction2_sqrt = sqrt(1 - beta2**step)``.
    Kernels receive these exact values so every implementation agrees on them.
    """
    if step < 1:
        raise ValueError(f"AdamW step must be >= 1 (got {step}); step counts start at 1")
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    return lr / bias_correction1, math.sqrt(bias_correction2)


def _check_flat(param, exp_avg, exp_avg_sq, grad) -> None:
    for name, t in (("param", param), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq), ("grad", grad)):
        if t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"adamw: {name} must be a contiguous 1-D float32 tensor, got {t.dtype} {tuple(t.shape)}")
    n = param.numel()
    if not (exp_avg.numel() == exp_avg_sq.numel() == grad.numel() == n):
        raise ValueError("adamw: param, exp_avg, exp_avg_sq and grad must have the same number of elements")


def adamw_step(
    param: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decay_segments: torch.Tensor,
) -> None:
    """One in-place AdamW step (decoupled weight decay) over a flat fp32 shard.

    ``decay_segments`` is an int64 tensor of shape (k, 2) holding shard-local
    half-open ranges ``[start, end)`` that receive weight decay; elements outside
    every range (biases, norms) are not decayed. Per element, in this order::

        p = p * (1 - lr * wd)                        # only inside decay ranges
        m = m * beta1 + (1 - beta1) * g
        v = v * beta2 + (1 - beta2) * g * g
        p = p - step_size * m / (sqrt(v) / bc2_sqrt + eps)
    """
    _check_flat(param, exp_avg, exp_avg_sq, grad)
    step_size, bc2_sqrt = adamw_scalars(step, lr, beta1, beta2)
    if weight_decay != 0.0:
        keep = 1.0 - lr * weight_decay
        for start, end in decay_segments.tolist():
            param[start:end].mul_(keep)
    exp_avg.mul_(beta1).add_(grad, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    denom = exp_avg_sq.sqrt().div_(bc2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
