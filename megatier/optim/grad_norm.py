"""This rank's part of the squared global gradient norm: the sum of squares of its gradient ranges that count
toward the norm (each element of the model counted once over all ranks; DistributedAdamW all-reduces the sums).

``native`` (optim.grad_norm_impl): torch, one float64 ``vector_norm`` per range.
``apex``: NVIDIA apex's ``multi_tensor_l2norm`` over every range in one fused launch, accumulating in float32: the
norm agrees with native to float32 rounding (a relative 1e-6 or so), and so does the clipping factor. Either way
the gradient a step consumed is what the checkpoints record, so recovery replays it exactly.
"""
from __future__ import annotations

import importlib

import torch

IMPLS = ("native", "apex")


def local_sumsq(grad: torch.Tensor, ranges: list[tuple[int, int]], impl: str = "native") -> torch.Tensor:
    """Sum of squares of ``grad[start:end]`` over ``ranges``: a float64 scalar on ``grad``'s device."""
    if impl not in IMPLS:
        raise ValueError(f"grad norm impl {impl!r} must be one of {', '.join(IMPLS)}")
    total = torch.zeros((), dtype=torch.float64, device=grad.device)
    if impl == "native" or not ranges:
        for start, end in ranges:
            total += torch.linalg.vector_norm(grad[start:end], dtype=torch.float64) ** 2
        return total
    amp_c = importlib.import_module("amp_C")
    applier = importlib.import_module("apex.multi_tensor_apply").multi_tensor_applier
    no_op = torch.zeros(1, dtype=torch.int32, device=grad.device)  # apex's skip flag: never set here
    norm, _ = applier(amp_c.multi_tensor_l2norm, no_op, [[grad[start:end] for start, end in ranges]], False)
    return total + norm.double().reshape(()) ** 2
