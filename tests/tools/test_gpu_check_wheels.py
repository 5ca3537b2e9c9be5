"""make gpu-check without the wheels make gpu-wheels fetches: one line saying to fetch them, exit 2, no phase."""
from __future__ import annotations

import os
import subprocess

import pytest

from tests.conftest import REPO


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dry", [True, False])
def test_gpu_check_without_wheels_says_to_run_make_gpu_wheels(tmp_path, dry):
    env = {**os.environ, "GPU_WHEELS": str(tmp_path / "wheels"), "OUT": str(tmp_path / "out")}
    proc = subprocess.run(["make", "--no-print-directory", "gpu-check", *(["DRY=1"] if dry else [])], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines()[0] == (f"gpu-check: no wheels in {tmp_path}/wheels; run `make gpu-wheels` first "
                                           f"(it fetches the pure-Python wheels the GPU machine lacks)")
    assert not (tmp_path / "out").exists()
