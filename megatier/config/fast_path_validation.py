"""Checks of the GPU fast paths a config asks for: ``model.impl``, ``model.layernorm_impl``,
``optim.grad_norm_impl`` and ``train.precision=fp8``.

Runs inside :func:`megatier.config.validate`, before any side effect: a path that is asked for must be able to run
here (:mod:`megatier.fastpaths` says what is missing and how to install it), and fp8 needs Transformer Engine's
layers and shapes its GEMMs accept. The defaults (native everywhere, no fp8) need nothing and import nothing.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from megatier import fastpaths
from megatier.config.schema import Config, ffn_size
from megatier.config.schema import require as _require

IMPLS = ("native", "te")
LAYERNORM_IMPLS = ("native", "apex")
GRAD_NORM_IMPLS = ("native", "apex")


def _require_cuda(key: str, device: str) -> None:
    _require(device != "cpu", f"{key} runs on CUDA only but train.device=cpu; set train.device=cuda (or auto) or "
                              f"drop {key}")
    missing = fastpaths.cuda_missing()
    _require(missing is None, f"{key} needs CUDA, but {missing}; run it on a GPU machine with a CUDA build of torch, "
                              f"or drop {key}")


def _fp8_shapes(cfg: Config, tp: int) -> Optional[str]:
    """The first GEMM dimension Transformer Engine's fp8 GEMMs cannot take (leading dims % 8, last dim % 16)."""
    m, h = cfg.model, cfg.model.hidden_size
    ffn = ffn_size(m)
    if m.arch == "llama":  # q and k-then-v rows in one GEMM
        qkv = (m.num_heads + 2 * (m.num_query_groups or m.num_heads)) * (h // m.num_heads)
        qkv_what = "(model.num_heads + 2 x model.num_query_groups) x head size / parallel.tp"
    else:
        qkv, qkv_what = 3 * h, "3 x model.hidden_size / parallel.tp"
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len
    if tokens % 8:
        return (f"train.micro_batch_size x data.seq_len = {tokens} tokens per micro-batch is not a multiple of 8; "
                f"choose sizes whose product is")
    for what, size in (("model.hidden_size", h), (qkv_what, qkv // tp),
                       ("model.hidden_size / parallel.tp", h // tp), ("the FFN size / parallel.tp", ffn // tp)):
        if size % 16:
            return f"{what} = {size} is not a multiple of 16; choose model sizes (or parallel.tp) that make it one"
    return None


def check_fast_path_config(cfg: Config, tp: int) -> None:
    """Raise ConfigError (one line) for a fast path that is unknown, cannot run here, or cannot take the shapes."""
    m, o, t = cfg.model, cfg.optim, cfg.train
    _require(m.impl in IMPLS, f"model.impl={m.impl!r} must be one of {', '.join(IMPLS)}")
    _require(m.layernorm_impl in LAYERNORM_IMPLS,
             f"model.layernorm_impl={m.layernorm_impl!r} must be one of {', '.join(LAYERNORM_IMPLS)}")
    _require(o.grad_norm_impl in GRAD_NORM_IMPLS,
             f"optim.grad_norm_impl={o.grad_norm_impl!r} must be one of {', '.join(GRAD_NORM_IMPLS)}")
    if t.precision == "fp8":
        _require(m.impl == "te", "train.precision=fp8 runs the GEMMs of Transformer Engine's layers in fp8 and needs "
                                 "model.impl=te; set model.impl=te or use train.precision=bf16")
    if m.impl == "te":
        _require_cuda("model.impl=te", t.device)
        missing = fastpaths.transformer_engine_missing()
        _require(missing is None, f"model.impl=te needs Transformer Engine: {missing}")
    if t.precision == "fp8":
        missing = fastpaths.fp8_missing()
        _require(missing is None, f"train.precision=fp8: {missing}; use train.precision=bf16 on this GPU")
        shapes = _fp8_shapes(cfg, tp)
        _require(shapes is None, f"train.precision=fp8: {shapes}")
    if m.layernorm_impl == "apex":
        _require_cuda("model.layernorm_impl=apex", t.device)
        missing = fastpaths.apex_layernorm_missing()
        _require(missing is None, f"model.layernorm_impl=apex needs NVIDIA apex: {missing}")
    if o.grad_norm_impl == "apex":
        _require_cuda("optim.grad_norm_impl=apex", t.device)
        missing = fastpaths.apex_grad_norm_missing()
        _require(missing is None, f"optim.grad_norm_impl=apex needs NVIDIA apex: {missing}")


def pick_device(name: str) -> torch.device:
    """train.device's device for this process (cuda: the LOCAL_RANK-th GPU); ConfigError when CUDA is asked for and
    missing."""
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        _require(torch.cuda.is_available(), "train.device=cuda but CUDA is not available; use train.device=cpu")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")
