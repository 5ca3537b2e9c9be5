"""megatier-launch's own arguments as a user types them: --help lists every option, a missing job is exit 2."""
from __future__ import annotations

import subprocess

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.timeout(60)
LAUNCH = str(REPO / ".venv" / "bin" / "megatier-launch")
NO_JOB = "no job to run: put the job after --, e.g. -- pretrain_gpt.py model=tiny"


def _launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([LAUNCH, *args], capture_output=True, text=True, cwd=REPO, timeout=50)


def test_help_lists_every_option_and_exits_0():
    proc = _launch("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: megatier-launch --nodes N --procs-per-node M [options] -- SCRIPT")
    for option in ("--nodes", "--procs-per-node", "--recovery", "--spares-per-node", "--spare-nodes",
                   "--fail-grace-s", "--max-restarts", "--port", "--respawn"):
        assert option in proc.stdout, option


@pytest.mark.parametrize("args,error", [
    (["--nodes", "2", "--procs-per-node", "1"], NO_JOB),
    (["--nodes", "2", "--procs-per-node", "1", "--"], NO_JOB),
    (["--nodes", "2", "--", "pretrain_gpt.py"], "the following arguments are required: --procs-per-node"),
])
def test_a_launch_without_a_job_or_a_required_option_is_a_usage_error(args, error):
    proc = _launch(*args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == f"megatier-launch: error: {error}"
