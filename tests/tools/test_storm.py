"""The failure storm, a short form: a job under in-process recovery with respawning agents loses a whole node
(agent, ranks, spares and memory; a new node of spares joins) and then a rank's process, recovers each in place
and ends bit-identical to the fault-free run."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(600)


@pytest.mark.slow
def test_a_node_and_a_process_lost_in_one_job_end_bit_identical(tmp_path):
    cmd = [sys.executable, str(REPO / "tools" / "chaos" / "storm.py"), "--faults", "2", "--interval-s", "5",
           "--iters", "160", "--seed", "1", "--work-dir", str(tmp_path / "work")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line[:3].strip() in ("1", "2")]
    assert [r[1] for r in rows] == ["node", "process"], proc.stdout[-3000:]
    assert all(r[4] != "-" for r in rows), proc.stdout[-3000:]  # each fault was followed by a recovery
    assert "joins with spares" in proc.stdout and "started as a spare in place of" in proc.stderr
    assert "RESULT: bit-identical to the fault-free run" in proc.stdout
    assert "Traceback" not in proc.stderr
