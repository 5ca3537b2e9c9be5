"""MegaTier: a 3D-parallel GPT trainer with tiered checkpointing.

``pip install --no-build-isolation -e .`` also builds the native ops extension
``megatier._C`` from megatier/csrc (C++/OpenMP; CUDA kernels when a CUDA build
of torch and a CUDA toolkit are present). Build knobs (environment variables):

* ``MEGATIER_CUDA=auto|0|1``: compile the CUDA kernels (auto: when torch is a
  CUDA build and CUDA_HOME is found; 1: require them; 0: never).
* ``MEGATIER_MARCH``: value of ``-march`` for the C++ kernels (default
  ``native``; set it to e.g. ``x86-64-v3`` for a portable build, or to an empty
  string to pass no ``-march``).
* ``MEGATIER_NO_EXT=1``: skip the extension (megatier.ops then falls back to its
  pure-torch reference implementation, with a warning).

Where pip cannot resolve the dependencies (a machine without network whose torch
is another build), build the extension in place and put the checkout on
``PYTHONPATH``: ``MEGATIER_CUDA=1 python setup.py build_ext --inplace``.
"""
import glob
import os
import platform

from setuptools import find_packages, setup

INSTALL_REQUIRES = [
    # The oldest torch the code runs on (its collectives: megatier.optim.collectives); the exact CPU build the
    # project develops on is pinned in the Makefile, so a GPU machine keeps the CUDA torch it has.
    "torch>=2.4",
    "hydra-core>=1.3,<1.4",
    "omegaconf>=2.3,<2.4",
    "wandb>=0.17",
    "numpy>=1.24",
    "safetensors>=0.4",
    "xxhash>=3.0",
    "fsspec>=2023.1",
    "boto3>=1.28",
    "tqdm>=4.60",
    # process titles: which rank or spare a process is, in ps and top
    "setproctitle>=1.3",
    "tokenizers>=0.15",
    # the Checkflow capture schedule (scipy.optimize.milp, HiGHS)
    "scipy>=1.9",
    # megatier-plot
    "matplotlib>=3.6",
]

EXTRAS = {
    "dev": [
        "pytest>=7",
        "pytest-timeout>=2.1",
        "pytest-xdist>=3.3",
        "hypothesis>=6",
        "moto[server]>=5",
        "ruff>=0.6",
        # the layering contracts in .importlinter (lint-imports, run by make test)
        "import-linter>=2.1",
        # megatier.interop writes and reads GPT-2 directories without it; the tests load them in transformers.
        "transformers>=4.40",
        # the reference the LR schedules are tested against (OptimizerParamScheduler); its own dependencies are
        # torch, numpy and packaging, so the CPU torch installed first stays. Never a runtime dependency.
        "megatron-core>=0.16,<0.17",
        # logging.tensorboard=true (imported only then); the tests read its event files back
        "tensorboard>=2.14",
        # megatier-preprocess's parquet, Hugging Face dataset and .zst inputs (the "data" extra), tested
        "datasets>=2.14",
        "zstandard>=0.21",
    ],
    # Transformer Engine's PyTorch layers (model.impl=te, train.precision=fp8); build it against the CUDA torch
    # already installed (--no-build-isolation). NVIDIA apex is not on PyPI (the package named apex there is
    # unrelated): docs/configuration.md, "GPU fast paths", builds it from NVIDIA's source.
    "gpu": ["transformer-engine[pytorch]"],
    # megatier-preprocess: parquet and Hugging Face datasets (datasets brings pyarrow), .zst JSON lines
    "data": ["datasets>=2.14", "zstandard>=0.21"],
    # logging.tensorboard=true: TensorBoard beside W&B (torch.utils.tensorboard writes, this package encodes)
    "tensorboard": ["tensorboard>=2.14"],
}

CSRC = os.path.join("megatier", "csrc")

# Compiler flags of the native ops; tools/cuda_compile.py reads these two lists (keep them literal).
# -g0: no debug info (Python's CFLAGS add -g: a 16 MB .so instead of 0.4 MB, and a slower build).
CXX_FLAGS = ["-O3", "-g0", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-Wall", "-Wno-unknown-pragmas"]
# --fmad=false keeps the AdamW update free of fused multiply-adds so the step and replay kernels (and the CPU
# ones) perform the same roundings.
NVCC_FLAGS = ["-O3", "--fmad=false", "-DMEGATIER_WITH_CUDA"]


def cuda_kernels_wanted(mode: str, torch_cuda: "str | None", cuda_home: "str | None") -> bool:
    """Whether to compile the CUDA kernels (MEGATIER_CUDA=``mode``, torch's CUDA version, the toolkit torch found);
    a RuntimeError with one line saying what is wrong and what to do when they are asked for and cannot be built.
    Torch guesses CUDA_HOME=/usr/local when it is unset: a folder without the CUDA headers is refused, since the
    build would fail deep inside nvcc instead."""
    if mode not in ("auto", "0", "1"):
        raise RuntimeError(f"MEGATIER_CUDA must be auto, 0 or 1 (got {mode!r})")
    if mode == "0":
        return False
    if torch_cuda is None:
        if mode == "1":
            raise RuntimeError("MEGATIER_CUDA=1 but the installed torch is a CPU build (torch.version.cuda is None); "
                               "install a CUDA build of torch, or build the CPU kernels with MEGATIER_CUDA=0")
        return False
    if cuda_home is None:
        if mode == "1":
            raise RuntimeError(f"MEGATIER_CUDA=1 but no CUDA toolkit was found for torch's CUDA {torch_cuda}; set "
                               f"CUDA_HOME to the toolkit that holds bin/nvcc and include/cuda_runtime.h")
        return False
    if not os.path.isfile(os.path.join(cuda_home, "include", "cuda_runtime.h")):
        raise RuntimeError(f"CUDA_HOME={cuda_home} has no include/cuda_runtime.h (torch guesses /usr/local when "
                           f"CUDA_HOME is unset); set CUDA_HOME to the CUDA toolkit with nvcc and its headers, or "
                           f"MEGATIER_CUDA=0 to build the CPU kernels only")
    return True


def _native_extension():
    """The megatier._C extension and its build command class, or ([], {}) when skipped."""
    if os.environ.get("MEGATIER_NO_EXT", "0") == "1":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError as exc:  # torch must be importable at build time (use --no-build-isolation)
        raise RuntimeError(
            "building megatier._C needs torch at build time: install torch first (the CPU build: torch==2.13.0), "
            "then run "
            "`pip install --no-build-isolation -e .` (or set MEGATIER_NO_EXT=1 to skip the native ops)"
        ) from exc

    with_cuda = cuda_kernels_wanted(os.environ.get("MEGATIER_CUDA", "auto").strip().lower(), torch.version.cuda,
                                    CUDA_HOME)

    sources = sorted(glob.glob(os.path.join(CSRC, "*.cpp")))
    cxx = list(CXX_FLAGS)
    march = os.environ.get("MEGATIER_MARCH", "native").strip()
    if march and platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64"):
        cxx.append(f"-march={march}")
    extra = {"cxx": cxx}
    ext_cls = CppExtension
    if with_cuda:
        sources += sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cu")))
        extra["cxx"] = extra["cxx"] + ["-DMEGATIER_WITH_CUDA"]
        extra["nvcc"] = list(NVCC_FLAGS)
        ext_cls = CUDAExtension
    ext = ext_cls(
        name="megatier._C",
        sources=sources,
        include_dirs=[os.path.abspath(CSRC)],
        extra_compile_args=extra,
        extra_link_args=["-fopenmp"],
    )
    return [ext], {"build_ext": BuildExtension}


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import its functions
    EXT_MODULES, CMDCLASS = _native_extension()

    setup(
        name="megatier",
        version="0.1.0",
        description="Megatron-style 3D-parallel GPT trainer with tiered checkpointing",
        # configs/ stays at the top of the repository, where users look for it; installed, it is megatier.configs.
        packages=[*find_packages(include=["megatier", "megatier.*"]), "megatier.configs"],
        package_dir={"megatier.configs": "configs"},
        package_data={"megatier": ["_C.pyi"], "megatier.configs": ["*.yaml", "*/*.yaml"]},
        python_requires=">=3.10",
        install_requires=INSTALL_REQUIRES,
        extras_require=EXTRAS,
        entry_points={"console_scripts": [
            "megatier-agent=megatier.cli.agent:main",
            "megatier-convert=megatier.cli.convert:main",
            "megatier-drill=megatier.cli.drill:main",
            "megatier-inspect=megatier.cli.inspect:main",
            "megatier-launch=megatier.cli.launch:main",
            "megatier-plot=megatier.cli.plot:main",
            "megatier-preprocess=megatier.cli.preprocess:main",
            "megatier-run=megatier.cli.run:main",
            "megatier-topology=megatier.cli.topology:main",
            "megatier-train=megatier.train:cli",
        ]},
        ext_modules=EXT_MODULES,
        cmdclass=CMDCLASS,
    )
