"""The randomized in-process crash drill, a short form: two seeded cases (a crash as a step begins and a second
one during its recovery's consensus; a machine lost with its agent, ranks and spare), each recovered in place
and bit-identical to the fault-free run."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(600)


def test_two_seeded_cases_recover_in_place_bit_identically(tmp_path):
    cmd = [sys.executable, str(REPO / "tools" / "chaos" / "random_crashes.py"), "--cases", "2", "--seed", "9",
           "--work-dir", str(tmp_path / "work")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "train.step_begin:10:2,recover.consensus:1:3" in proc.stdout and ":node" in proc.stdout
    assert "2 ended as required (in place: 2)" in proc.stdout and "RESULT: every case recovered exactly" in proc.stdout
