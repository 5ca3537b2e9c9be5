"""MegaTier installs the way users install packages: a wheel, in a fresh virtual environment that has the
dependencies but not the source tree, trains with ``megatier-train`` from an empty directory."""
from __future__ import annotations

import glob
import os
import shutil
import site
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(600)
SKIP = shutil.ignore_patterns(".git", ".venv", "build", "runs", "outputs", "*.so", "__pycache__", "*.egg-info",
                              ".pytest_cache", ".hypothesis")


def test_a_wheel_installed_elsewhere_trains_from_an_empty_directory(tmp_path, corpus_prefix):
    src, wheels, venv, empty = (tmp_path / n for n in ("src", "wheels", "venv", "empty"))
    shutil.copytree(REPO, src, ignore=SKIP)
    # Without the native ops: building them is the slow part, and it is the same build `make install` tests.
    env = {k: v for k, v in os.environ.items() if k != "MEGATIER_REQUIRE_NATIVE"}
    env["MEGATIER_NO_EXT"] = "1"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(src)], check=True, env=env, cwd=tmp_path, timeout=300)
    (wheel,) = glob.glob(str(wheels / "megatier-*.whl"))
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], check=True,
                   env=env, timeout=300)
    inner = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                           check=True, capture_output=True, text=True).stdout.strip()
    # The dependencies of this environment, as a plain path entry: its .pth files (the editable install of the
    # source tree among them) are not processed, so megatier can only come from the wheel.
    with open(os.path.join(inner, "megatier_deps.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    empty.mkdir()
    proc = subprocess.run([str(venv / "bin" / "megatier-train"), "model=tiny", "train.iters=3",
                           f"data.prefix={corpus_prefix}", "data.seq_len=64", "logging.wandb.mode=disabled",
                           "logging.progress=false"], cwd=empty, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "done: step 3" in proc.stdout
    found = subprocess.run([str(py), "-c", "import megatier; print(megatier.__file__)"], cwd=empty,
                           capture_output=True, text=True).stdout
    assert found.startswith(inner), found  # the wheel's copy, not the source tree
    assert (empty / "runs" / "tiny" / "metrics.jsonl").exists()
