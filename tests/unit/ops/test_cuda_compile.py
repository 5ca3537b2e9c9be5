"""The CUDA build of megatier._C compiles without a GPU (tools/cuda_compile.py), whenever the CUDA compiler
packages are installed in build/cuda-toolchain (`make test-slow` installs them with `python -m tools.cuda_compile
install`)."""
from __future__ import annotations

import pytest

from tools.cuda_compile import DEFAULT_TOOLCHAIN, compile_cuda_build, link_and_list_undefined, nvcc_path, setup_flags

needs_toolchain = pytest.mark.skipif(
    not nvcc_path(DEFAULT_TOOLCHAIN).exists(),
    reason=f"no CUDA compiler at {nvcc_path(DEFAULT_TOOLCHAIN)}: `python -m tools.cuda_compile install` installs it",
)


def test_the_check_compiles_with_setup_py_flags():
    # The check reads the flags a CUDA build gets from setup.py itself, so the two cannot drift apart.
    assert "--fmad=false" in setup_flags("NVCC_FLAGS") and "-DMEGATIER_WITH_CUDA" in setup_flags("NVCC_FLAGS")
    assert "-ffp-contract=off" in setup_flags("CXX_FLAGS")


@pytest.fixture(scope="module")
def cuda_build(tmp_path_factory):
    return compile_cuda_build(DEFAULT_TOOLCHAIN, tmp_path_factory.mktemp("cuda_build"), jobs=1)


@pytest.mark.slow
@needs_toolchain
@pytest.mark.timeout(900)
def test_cuda_build_compiles_and_defines_every_megatier_symbol(cuda_build):
    assert [o.name for o in cuda_build.objects] == ["ops_cuda.cu.o", "adamw.o", "bindings.o", "compression.o",
                                                    "pieces.o", "team.o"]
    assert all(o.stat().st_size > 0 for o in cuda_build.objects) and cuda_build.shared_object.exists()
    assert cuda_build.undefined_megatier == []
    # Our sources compile without a warning (torch's own headers may warn; none of those come from megatier/).
    assert not [w for w in cuda_build.warnings if "megatier/csrc" in w.split(":\n", 1)[1]], cuda_build.warnings


@pytest.mark.slow
@needs_toolchain
@pytest.mark.timeout(900)
def test_the_link_check_names_kernels_nothing_defines(cuda_build, tmp_path):
    without_cuda = [o for o in cuda_build.objects if not o.name.endswith(".cu.o")]
    undefined = link_and_list_undefined(without_cuda, tmp_path / "no_kernels.so")
    assert any(s.startswith("megatier::adamw_replay_cuda(") for s in undefined), undefined
    assert any(s.startswith("megatier::quantize_int8_cuda(") for s in undefined), undefined
