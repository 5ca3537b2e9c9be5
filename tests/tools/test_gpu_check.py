"""The GPU check's dry run (make gpu-check DRY=1): every phase that needs no GPU passes here, so the script the
lent GPU machine runs cannot rot between the sessions that are lent one."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

WHEELS = REPO / "build" / "gpu-wheels"
pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not list(WHEELS.glob("*.whl")),
                                 reason=f"no wheels in {WHEELS}: `make gpu-wheels` fetches them (.ci/run does)")]


def test_the_dry_run_passes_every_phase(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MEGATIER_NODE_NAME")}
    proc = subprocess.run(["bash", str(REPO / "tools" / "gpu" / "check.sh"), "--dry"], cwd=REPO,
                          env={**env, "OUT": str(tmp_path), "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=580)
    summary = (tmp_path / "summary.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in summary] == ["env", "build", "tests", "compress", "syncs", "bench",
                                                        "throughput"], \
        proc.stdout
    assert proc.returncode == 0, proc.stdout + "".join((tmp_path / f"{line.split(':')[0]}.log").read_text()[-2000:]
                                                       for line in summary if ": exit 0 " not in line)
    assert "tests/gpu" in (tmp_path / "tests.log").read_text()  # collected, not run
    assert "megatier" in (tmp_path / "bench.log").read_text().splitlines()[-1]  # the table's row
    assert "the same record both ways" in (tmp_path / "compress.log").read_text()
    assert "0 host syncs over 3 steps on cpu" in (tmp_path / "syncs.log").read_text()  # the CPU never waits
    rows = [line.split()[0] for line in (tmp_path / "throughput.log").read_text().splitlines()[-3:]]
    assert rows == ["megatier", "megatier_compile", "plain"]  # the table's rows
