"""Loading of the compiled extension ``megatier._C`` and the fallback policy.

* ``MEGATIER_REQUIRE_NATIVE=1``: a missing or broken extension is an ImportError
  at ``import megatier.ops`` (CI sets it, so tests never silently run the reference).
* ``MEGATIER_DISABLE_NATIVE=1``: ignore the extension (used by tests of the fallback).
* Otherwise a missing extension means the pure-torch reference is used, with a
  one-time RuntimeWarning at the first op that falls back.
"""
from __future__ import annotations

import contextlib
import os
import threading
import warnings
from types import ModuleType
from typing import Callable, Iterator, Optional, TypeVar

import torch

T = TypeVar("T")

BUILD_HINT = "build it with `pip install --no-build-isolation -e .` (needs torch, pybind11, ninja and a C++ compiler)"

_C: Optional[ModuleType] = None
LOAD_ERROR: Optional[str] = None

if os.environ.get("MEGATIER_DISABLE_NATIVE", "0") == "1":
    LOAD_ERROR = "disabled by MEGATIER_DISABLE_NATIVE=1"
else:
    try:
        from megatier import _C as _loaded  # type: ignore[attr-defined]

        _C = _loaded
    except ImportError as exc:  # not built, or built against another torch
        LOAD_ERROR = f"{type(exc).__name__}: {exc}"

if _C is None and os.environ.get("MEGATIER_REQUIRE_NATIVE", "0") == "1":
    raise ImportError(
        f"MEGATIER_REQUIRE_NATIVE=1 but the native ops extension megatier._C is not available ({LOAD_ERROR}); "
        f"{BUILD_HINT}"
    )

_warned = False
_warn_lock = threading.Lock()


def native_available() -> bool:
    """True when the compiled kernels (megatier._C) are in use, False when the reference is."""
    return _C is not None


def native_info() -> dict:
    """How the ops are served: ``{"native": bool, "cuda": bool, "openmp": bool, "max_threads": int, "error": "
                                                                                                          "str|None}``."""
    if _C is None:
        return {"native": False, "cuda": False, "openmp": False, "max_threads": 1, "error": LOAD_ERROR}
    info = dict(_C.build_info())
    info.update(native=True, error=None)
    return info


def limit_thread_parallelism(n: int = 1) -> bool:
    """Let parallel regions started by the *calling* thread use at most ``n`` threads (native and ATen ops).

    For helper threads (checkpoint serialization) that must not oversubscribe the cores the training
    loop's own OpenMP team runs on. Returns False where that cannot be done (no extension or no OpenMP).
    """
    if _C is None:
        return False
    # ATen sizes a thread's OpenMP setting lazily on its first parallel op; do that first so it cannot
    # overwrite ours afterwards.
    torch.get_num_threads()
    return bool(_C.set_thread_num_threads(int(n)))


def run_with_team_parked(fn: Callable[[], T]) -> T:
    """``fn()`` on the calling thread while the other threads of its OpenMP team sleep; returns its result.

    An idle team thread spins for several milliseconds before it sleeps (libgomp's default wait policy), so
    serial work between two parallel ops, such as the checkpoint hook of a CPU training loop, burns a
    second core meanwhile. Inside ``fn`` ATen and our kernels run on the calling thread alone (the caller is
    in a parallel region), so work that should use the team goes before or after. Exceptions propagate.
    Without the extension (or OpenMP, or with a team of one) this is plain ``fn()``.
    """
    if _C is None:
        return fn()
    return _C.run_with_team_parked(fn)


@contextlib.contextmanager
def thread_parallelism(n: int) -> Iterator[None]:
    """Inside, parallel regions the calling thread starts (native and ATen ops) use at most ``n`` threads; the
    thread's setting is restored on leaving. ``n`` <= 0 leaves it as it is."""
    if n <= 0 or _C is None:
        yield
        return
    before = torch.get_num_threads()  # also sizes ATen's setting first (see limit_thread_parallelism)
    _C.set_thread_num_threads(int(n))
    try:
        yield
    finally:
        _C.set_thread_num_threads(before)


def _warn_fallback(reason: str) -> None:
    global _warned
    with _warn_lock:
        if _warned:
            return
        _warned = True
    warnings.warn(
        f"megatier.ops: {reason}; using the pure-torch reference implementation (much slower). {BUILD_HINT}",
        RuntimeWarning,
        stacklevel=4,
    )


def use_native(t: torch.Tensor) -> bool:
    """Whether the compiled kernel serves tensors on ``t``'s device (warns once when it does not)."""
    if _C is None:
        _warn_fallback(f"native extension unavailable ({LOAD_ERROR})")
        return False
    if t.device.type == "cpu":
        return True
    if t.device.type == "cuda" and bool(_C.WITH_CUDA):
        return True
    _warn_fallback(f"megatier._C has no kernels for device {t.device} (built with CUDA: {bool(_C.WITH_CUDA)})")
    return False


def lib() -> ModuleType:
    assert _C is not None
    return _C
