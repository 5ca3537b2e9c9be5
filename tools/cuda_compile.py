"""Compile MegaTier's CUDA build on a machine without a GPU: proof that the CUDA sources compile.

    python -m tools.cuda_compile install         # pip-install the CUDA compiler into build/cuda-toolchain
    python -m tools.cuda_compile check           # compile the CUDA build with it (both: install check)

``tests/unit/ops/test_cuda_compile.py`` runs the check whenever the toolchain is installed;
``make test-slow`` installs it.

What it compiles, with the flags ``setup.py`` gives a CUDA build (its ``CXX_FLAGS`` and ``NVCC_FLAGS``, read from
the file, plus what torch's ``BuildExtension`` adds: ``COMMON_NVCC_FLAGS``, ``-std=c++20``, ``-fPIC``, the
extension defines and the C++ ABI flag), against the headers of the installed torch:

* ``megatier/csrc/cuda/*.cu`` with nvcc, device code for ``--arch`` (default sm_80 and sm_90), to object files;
* ``megatier/csrc/*.cpp`` with the host compiler and ``-DMEGATIER_WITH_CUDA`` (``bindings.cpp`` then dispatches
  to the ``*_cuda`` kernels);
* one shared object linked from all of them, in which no ``megatier::`` symbol may stay undefined (every op
  ``ops.h`` declares for CUDA and ``bindings.cpp`` calls is defined by the ``.cu`` file).

What it cannot prove: that the kernels run (no GPU), nor that the object links against ``libtorch_cuda`` and
``libc10_cuda``, which a CPU build of torch does not ship (their symbols stay undefined, as in any extension until
it is loaded).

The toolchain is CUDA 13.0 as Python packages (``TOOLCHAIN``), installed with ``pip --target`` outside the
project's environment; all of them unpack into ``<dir>/nvidia/cu13`` (``bin/nvcc``, ``include``, ``nvvm``, ...).
The CUDA 12 packages cannot serve: ``nvidia-cuda-nvcc-cu12`` ships ``ptxas`` and NVVM for JIT compilers, not the
``nvcc`` driver (nor ``cudafe++``). CUDA 13's runtime headers include CCCL's (``<nv/target>``), hence
``nvidia-cuda-cccl``.

One header of a CUDA build of torch is missing from the CPU wheel: ``c10/cuda/impl/cuda_cmake_macros.h``, which
CMake generates. On Linux it defines nothing the headers read (``C10_CUDA_BUILD_SHARED_LIBS`` matters on Windows
only; its ``TORCH_CUDA_VERSION_*`` macros are used by no header), so when it is absent the compile passes
``-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE``, the switch ``c10/cuda/CUDAMacros.h`` has for builds without it. Every
other header the CUDA sources include is in the CPU wheel.
"""
from __future__ import annotations

import argparse
import ast
import glob
import os
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CSRC = REPO / "megatier" / "csrc"
DEFAULT_TOOLCHAIN = REPO / "build" / "cuda-toolchain"
DEFAULT_OUT = REPO / "build" / "cuda-check"
# CUDA 13.0, every package of one release (nvcc refuses a newer crt or nvvm than its own).
TOOLCHAIN = ("nvidia-cuda-nvcc==13.0.88", "nvidia-cuda-crt==13.0.88", "nvidia-nvvm==13.0.88",
             "nvidia-cuda-runtime==13.0.96", "nvidia-cuda-cccl==13.0.85")
DEFAULT_ARCHS = ("8.0", "9.0")  # A100, H100/H200


def cuda_root(toolchain: Path) -> Path:
    """The CUDA tree the packages unpack into (bin/nvcc, include, nvvm)."""
    return toolchain / "nvidia" / "cu13"


def nvcc_path(toolchain: Path) -> Path:
    return cuda_root(toolchain) / "bin" / "nvcc"


def install(toolchain: Path) -> None:
    """pip-install TOOLCHAIN into ``toolchain`` (replacing what is there), not into the running environment."""
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--upgrade",
           "--target", str(toolchain), *TOOLCHAIN]
    subprocess.run(cmd, check=True)


def setup_flags(name: str) -> list[str]:
    """The literal list assigned to ``name`` at the top level of setup.py (its CXX_FLAGS or NVCC_FLAGS)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise ValueError(f"setup.py assigns no {name} at its top level")


@dataclass
class Result:
    """Objects built, the shared object linked from them, seconds per step and the compilers' warnings."""

    objects: list[Path]
    shared_object: Path
    seconds: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    undefined_megatier: list[str] = field(default_factory=list)


def _torch_flags() -> tuple[list[str], list[str]]:
    """(include flags, defines) as BuildExtension gives the sources of an extension named megatier._C."""
    import torch
    from torch.utils.cpp_extension import include_paths

    includes = [*include_paths(), sysconfig.get_paths()["include"], str(CSRC)]
    defines = ["-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C",
               f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"]
    generated = Path(include_paths()[0]) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    if not generated.exists():  # a CPU build of torch: see the module docstring
        defines.append("-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE")
    return [f"-I{p}" for p in includes], defines


def _run(cmd: list[str], what: str) -> str:
    """Run a compiler; its warnings (stderr) on success, a RuntimeError naming ``what`` with them on failure."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    return proc.stderr.strip()


def compile_cuda_build(toolchain: Path, out: Path, *, archs=DEFAULT_ARCHS, jobs: int = 1) -> Result:
    """Compile every source of a CUDA build of megatier._C into ``out`` and link them (see the module docstring)."""
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

    nvcc = nvcc_path(toolchain)
    if not nvcc.exists():
        raise FileNotFoundError(f"no nvcc at {nvcc}; install the toolchain with `python -m tools.cuda_compile "
                                f"install` (or pass --toolchain)")
    out.mkdir(parents=True, exist_ok=True)
    includes, defines = _torch_flags()
    cuda_include = f"-I{cuda_root(toolchain) / 'include'}"
    gencode = [f"-gencode=arch=compute_{a.replace('.', '')},code=sm_{a.replace('.', '')}" for a in archs]
    nvcc_cmd = [str(nvcc), *COMMON_NVCC_FLAGS, "--compiler-options", "-fPIC", *setup_flags("NVCC_FLAGS"), *gencode,
                "-std=c++20", *includes, *defines]
    cxx_cmd = [os.environ.get("CXX", "g++"), *setup_flags("CXX_FLAGS"), "-DMEGATIER_WITH_CUDA", "-std=c++20", "-fPIC",
               *includes, cuda_include, *defines]
    jobs_list = [(src, [*nvcc_cmd, "-c", src, "-o", str(out / (Path(src).stem + ".cu.o"))])
                 for src in sorted(glob.glob(str(CSRC / "cuda" / "*.cu")))]
    jobs_list += [(src, [*cxx_cmd, "-c", src, "-o", str(out / (Path(src).stem + ".o"))])
                  for src in sorted(glob.glob(str(CSRC / "*.cpp")))]
    result = Result(objects=[Path(cmd[-1]) for _, cmd in jobs_list], shared_object=out / "megatier_C_cuda.so")

    def build(item):
        src, cmd = item
        start = time.perf_counter()
        warnings = _run(cmd, f"compiling {os.path.relpath(src, REPO)}")
        return os.path.relpath(src, REPO), time.perf_counter() - start, warnings

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        for name, seconds, warnings in pool.map(build, jobs_list):
            result.seconds[name] = seconds
            if warnings:
                result.warnings.append(f"{name}:\n{warnings}")
    start = time.perf_counter()
    result.undefined_megatier = link_and_list_undefined(result.objects, result.shared_object)
    result.seconds["link"] = time.perf_counter() - start
    return result


def link_and_list_undefined(objects: list[Path], shared_object: Path) -> list[str]:
    """Link ``objects`` into ``shared_object`` and return the ``megatier::`` symbols it leaves undefined.

    A shared object may leave symbols undefined (torch's and CUDA's are resolved when it is loaded); megatier's
    own must all be defined by its objects."""
    _run([os.environ.get("CXX", "g++"), "-shared", "-fopenmp", "-o", str(shared_object), *map(str, objects)],
         "linking")
    proc = subprocess.run(["nm", "-C", "--undefined-only", str(shared_object)], capture_output=True, text=True,
                          check=True)
    return [line.split(maxsplit=1)[-1] for line in proc.stdout.splitlines() if "megatier::" in line]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.cuda_compile", description=__doc__.split("\n\n")[0])
    p.add_argument("steps", nargs="+", choices=("install", "check"),
                   help=f"install: pip-install {', '.join(TOOLCHAIN)}; check: compile and link the CUDA build")
    p.add_argument("--toolchain", type=Path, default=DEFAULT_TOOLCHAIN, help="where the packages go / are")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for the objects")
    p.add_argument("--arch", nargs="+", default=list(DEFAULT_ARCHS), help="compute capabilities (e.g. 8.0 9.0)")
    p.add_argument("--jobs", type=int, default=2, help="compilers run at once")
    args = p.parse_args(argv)
    started = time.perf_counter()
    if "install" in args.steps:
        install(args.toolchain)
        print(f"installed {' '.join(TOOLCHAIN)} into {args.toolchain} in {time.perf_counter() - started:.1f} s")
    if "check" not in args.steps:
        return 0
    started = time.perf_counter()
    version = subprocess.run([str(nvcc_path(args.toolchain)), "--version"], capture_output=True, text=True)
    print(version.stdout.strip().splitlines()[-1] if version.returncode == 0 else f"nvcc: {version.stderr}")
    try:
        result = compile_cuda_build(args.toolchain, args.out, archs=args.arch, jobs=args.jobs)
    except (RuntimeError, FileNotFoundError) as exc:
        print(f"FAILED: {exc}")
        return 1
    for name, seconds in result.seconds.items():
        print(f"  {name}: {seconds:.1f} s")
    for warning in result.warnings:
        print(f"warning from {warning}")
    if result.undefined_megatier:
        print("FAILED: megatier symbols left undefined: " + "; ".join(result.undefined_megatier))
        return 1
    print(f"OK: {len(result.objects)} objects and {os.path.relpath(result.shared_object, REPO)} "
          f"(sm {' '.join(args.arch)}) in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
