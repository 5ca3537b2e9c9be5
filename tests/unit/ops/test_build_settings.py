"""setup.py's choice of the CUDA build: one clear line when the kernels are asked for and cannot be built."""
from __future__ import annotations

import runpy

import pytest

from tests.conftest import REPO

wanted = runpy.run_path(str(REPO / "setup.py"), run_name="setup_under_test")["cuda_kernels_wanted"]


def test_a_cpu_torch_builds_the_cpu_kernels_unless_cuda_is_required():
    assert wanted("auto", None, None) is False and wanted("0", "13.0", "/usr/local/cuda") is False
    with pytest.raises(RuntimeError, match=r"^MEGATIER_CUDA=1 but the installed torch is a CPU build") as e:
        wanted("1", None, "/usr/local/cuda")
    assert "\n" not in str(e.value)


def test_a_cuda_home_without_headers_is_refused_in_one_line(tmp_path):
    with pytest.raises(RuntimeError, match=r"CUDA_HOME=.* has no include/cuda_runtime.h .* MEGATIER_CUDA=0") as e:
        wanted("auto", "13.0", str(tmp_path))
    assert "\n" not in str(e.value)
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cuda_runtime.h").write_text("")
    assert wanted("auto", "13.0", str(tmp_path)) is True
    assert wanted("auto", "13.0", None) is False  # no toolkit found: the CPU kernels
    with pytest.raises(RuntimeError, match="no CUDA toolkit was found"):
        wanted("1", "13.0", None)
    with pytest.raises(RuntimeError, match="must be auto, 0 or 1"):
        wanted("yes", "13.0", None)
