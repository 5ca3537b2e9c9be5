"""Which implementation megatier.ops uses: the compiled extension, or the reference with one warning."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megatier import ops


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATIER_")}
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=120)


def test_native_in_use_when_required():
    if os.environ.get("MEGATIER_REQUIRE_NATIVE") == "1":
        assert ops.native_available()  # CI: the tests must exercise the compiled kernels
    info = ops.native_info()
    assert info["native"] == ops.native_available()
    if info["native"]:
        assert info["openmp"] and info["max_threads"] >= 1
        from megatier import _C

        assert set(_C.__dict__) >= {"quantize_int8", "sparsify_topk", "adamw_step", "adamw_replay", "build_info"}


@pytest.mark.skipif(not ops.native_available(), reason="needs megatier._C")
def test_an_error_inside_the_extension_raises_and_the_process_lives():
    """A check failing in C++ reaches Python as a RuntimeError. Run apart: where the build's C++ runtime cannot
    unwind into torch's (seen on a GPU machine's own compiler), the throw kills the process instead."""
    proc = _run("import torch\nfrom megatier import _C\n"
                "try:\n    _C.quantize_int8(torch.ones(4), 0, None, None)\n"
                "except RuntimeError as e:\n    print('raised:', e)\n")
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    assert "raised:" in proc.stdout and "block_size must be >= 1" in proc.stdout


FALLBACK = """
import warnings, torch
from megatier import ops
assert not ops.native_available(), ops.native_info()
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    x = torch.randn(1000)
    ops.quantize_int8(x, 64)
    ops.sparsify_topk(x, 0.1)
    p, m, v = torch.zeros(1000), torch.zeros(1000), torch.zeros(1000)
    ops.adamw_step(p, m, v, x, 1, 1e-3, 0.9, 0.95, 1e-8, 0.0, torch.empty(0, 2, dtype=torch.int64))
    rec = ops.compress_segments(x, [(0, 400), (400, 600)], "adaptive", 0.1, 500)
    no_decay = torch.empty(0, 2, dtype=torch.int64)
    ops.adamw_replay(p, m, v, [x, rec], [2, 3], [1e-3, 1e-3], 0.9, 0.95, 1e-8, 0.0, no_decay)
msgs = [str(x.message) for x in w if issubclass(x.category, RuntimeWarning)]
assert len(msgs) == 1, msgs
assert "reference" in msgs[0] and "pip install --no-build-isolation -e ." in msgs[0], msgs[0]
print("ok")
"""


def test_fallback_warns_once():
    r = _run(FALLBACK, MEGATIER_DISABLE_NATIVE="1")
    assert r.returncode == 0, r.stderr
    assert "ok" in r.stdout


def test_require_native_turns_missing_extension_into_error():
    r = _run("import megatier.ops", MEGATIER_DISABLE_NATIVE="1", MEGATIER_REQUIRE_NATIVE="1")
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "MEGATIER_REQUIRE_NATIVE=1" in r.stderr


@pytest.mark.skipif(not ops.native_available(), reason="megatier._C not built")
def test_require_native_passes_when_built():
    r = _run("import megatier.ops as o; assert o.native_available(); print('ok')", MEGATIER_REQUIRE_NATIVE="1")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr
