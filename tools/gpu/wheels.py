"""Fetch, here (with the package registry), the pure-Python wheels the GPU machine lacks: ``make gpu-wheels``.

    python -m tools.gpu.wheels                # into build/gpu-wheels
    python -m tools.gpu.wheels --dest DIR

The lent GPU machine (Python 3.12, torch 2.11 with CUDA, no network) has the numeric stack but not what MegaTier
composes configs and reaches S3 with: hydra-core, omegaconf and antlr4-python3-runtime (an sdist only: built into
a wheel here), boto3, botocore, s3transfer and jmespath, and setproctitle (a compiled extension: its CPython 3.12
manylinux wheel). The versions are this environment's, so the device runs
what the tests here ran. wandb stays behind (runs there use ``logging.wandb.mode=disabled``), and so does
Transformer Engine (its core wheel alone is far over what a device call carries). A trimmed NVIDIA apex wheel
built for the device (``apex-*.whl``: only ``amp_C`` and ``fused_layer_norm_cuda``, for torch 2.11+cu130 and
sm_90) is copied in too from the folder ``--apex`` or ``MEGATIER_APEX_DIR`` names, so the apex tests run there.
"""
from __future__ import annotations

import argparse
import glob
import importlib.metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_DEST = REPO / "build" / "gpu-wheels"
PURE = ("hydra-core", "omegaconf", "boto3", "botocore", "s3transfer", "jmespath")
SDIST_ONLY = ("antlr4-python3-runtime",)
COMPILED = ("setproctitle",)


def pinned(names) -> list[str]:
    return [f"{n}=={importlib.metadata.version(n)}" for n in names]


def fetch(dest: Path, apex: "Path | None") -> list[str]:
    """Download (and build) the wheels into ``dest``; returns their file names."""
    dest.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                    "--implementation", "cp", "--platform", "any", "-d", str(dest), *pinned(PURE)], check=True)
    subprocess.run([*pip, "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                    "--implementation", "cp", "--platform", "manylinux2014_x86_64", "-d", str(dest),
                    *pinned(COMPILED)], check=True)
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "-w", str(dest), *pinned(SDIST_ONLY)], check=True)
    for wheel in glob.glob(str(apex / "apex-*.whl")) if apex is not None else []:
        shutil.copy2(wheel, dest)
    return sorted(os.listdir(dest))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    apex = os.environ.get("MEGATIER_APEX_DIR")
    p.add_argument("--apex", type=Path, default=Path(apex) if apex else None,
                   help="folder holding the device's prebuilt apex wheel (default: $MEGATIER_APEX_DIR)")
    args = p.parse_args(argv)
    names = fetch(args.dest, args.apex)
    size = sum((args.dest / n).stat().st_size for n in names)
    print(f"{len(names)} wheels, {size / 2**20:.1f} MiB, in {args.dest}: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
