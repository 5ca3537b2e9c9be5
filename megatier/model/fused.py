"""LayerNorm on NVIDIA apex's fused kernel (``model.layernorm_impl=apex``).

``apex.normalization.FusedLayerNorm`` is a drop-in for ``nn.LayerNorm`` over the last dimension: the same
parameters (``weight`` and ``bias`` of shape (h,), initialised to ones and zeros), the same function (statistics in
fp32 for low-precision inputs), one CUDA kernel for forward and one for backward. It needs CUDA tensors (on CPU apex
itself calls ``F.layer_norm``); config validation has checked that apex's CUDA extension is there.
"""
from __future__ import annotations

import importlib

from torch import nn


def fused_layer_norm(hidden_size: int, eps: float) -> nn.Module:
    """apex's FusedLayerNorm over a last dimension of ``hidden_size``."""
    normalization = importlib.import_module("apex.normalization")
    return normalization.FusedLayerNorm(hidden_size, eps=eps)
