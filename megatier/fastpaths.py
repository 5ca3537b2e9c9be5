"""Whether the GPU fast paths a config asks for can run here: CUDA, Transformer Engine, NVIDIA apex.

Each check returns None when its path can run, else one line saying what is missing and how to install it;
config validation (:mod:`megatier.config.fast_path_validation`) raises that line as a ConfigError before any
work. Nothing falls back: a path that is asked for and missing stops the run.

NVIDIA apex is told apart from the unrelated PyPI package of the same name by its CUDA extensions:
``fused_layer_norm_cuda`` (FusedLayerNorm) and ``amp_C`` (the multi-tensor kernels), which only NVIDIA's
source build with ``--cuda_ext`` installs.
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch

TE_MIN_VERSION = (2, 9)  # transformer_engine.pytorch.autocast and is_fp8_available
TE_INSTALL = ("install it on a machine with CUDA and a CUDA build of torch: "
              "`pip install --no-build-isolation 'transformer-engine[pytorch]'` "
              "(docs/configuration.md: GPU fast paths)")
APEX_INSTALL = ("build NVIDIA's apex from source with its CUDA extensions: `pip install -v --no-build-isolation "
                "--config-settings '--build-option=--cpp_ext' --config-settings '--build-option=--cuda_ext' "
                "git+https://github.com/NVIDIA/apex` (the PyPI package named apex is unrelated; "
                "docs/configuration.md: GPU fast paths)")


def cuda_missing() -> Optional[str]:
    """Why CUDA cannot be used here, or None."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is a CPU build"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False (no GPU or driver visible)"
    return None


def _import_error(module: str) -> Optional[str]:
    """Why ``import module`` fails (its exception in one line), or None."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # an extension that fails to load raises OSError or RuntimeError, not ImportError
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
    return None


def _version(text: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as "2.9.0+a1b2c3"."""
    major, _, rest = text.partition(".")
    minor = "".join(ch for ch in rest.split(".")[0] if ch.isdigit())
    return int("".join(ch for ch in major if ch.isdigit()) or 0), int(minor or 0)


def transformer_engine_missing() -> Optional[str]:
    """Why Transformer Engine's PyTorch layers cannot be used, or None."""
    error = _import_error("transformer_engine.pytorch")
    if error is not None:
        return f"Transformer Engine cannot be imported ({error}); {TE_INSTALL}"
    found = str(getattr(importlib.import_module("transformer_engine"), "__version__", "0"))
    if _version(found) < TE_MIN_VERSION:
        return f"Transformer Engine {found} is older than {'.'.join(map(str, TE_MIN_VERSION))}; {TE_INSTALL}"
    return None


def fp8_missing() -> Optional[str]:
    """Why Transformer Engine's fp8 GEMMs cannot run on this GPU, or None (call after transformer_engine_missing)."""
    te = importlib.import_module("transformer_engine.pytorch")
    available, reason = te.is_fp8_available(return_reason=True)
    return None if available else f"Transformer Engine reports no fp8 support on this GPU ({reason})"


def _nvidia_apex_missing(extension: str, modules: tuple[str, ...]) -> Optional[str]:
    error = _import_error("apex")
    if error is not None:
        return f"NVIDIA apex cannot be imported ({error}); {APEX_INSTALL}"
    for module in (extension, *modules):
        error = _import_error(module)
        if error is not None:
            return (f"the installed apex is not NVIDIA's with its CUDA extensions ({module}: {error}); "
                    f"{APEX_INSTALL}")
    return None


def apex_layernorm_missing() -> Optional[str]:
    """Why NVIDIA apex's FusedLayerNorm cannot be used, or None."""
    return _nvidia_apex_missing("fused_layer_norm_cuda", ("apex.normalization",))


def apex_grad_norm_missing() -> Optional[str]:
    """Why NVIDIA apex's fused multi-tensor L2 norm cannot be used, or None."""
    return _nvidia_apex_missing("amp_C", ("apex.multi_tensor_apply",))
