"""A refusal under megatier-run prints its one line every time, however late rank 0 reaches it: the ranks that
refuse first wait for rank 0's line before they exit (torchrun's agent stops the others at the first exit)."""
from __future__ import annotations

import os
import subprocess
import time

import pytest

from megatier.training.outcome import REFUSAL_WAIT_S
from tests.conftest import REPO

pytestmark = pytest.mark.timeout(120)
LINE = ("config error: world size 2 is not divisible by parallel.tp=3 x parallel.pp=1; launch a multiple of 3 "
        "processes or change the layout")


def test_a_refusal_is_printed_when_rank_0_reaches_it_after_the_others_exit():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "MEGATIER_NODE_NAME", "GROUP_RANK")}
    env.update(OMP_NUM_THREADS="1", LATE_RANK0_S="3")
    cmd = [str(REPO / ".venv" / "bin" / "megatier-run"), "--standalone", "--nproc-per-node", "2",
           "tests/unit/training/late_rank0.py", "model=tiny", "parallel.tp=3"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=110)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert [line for line in proc.stderr.splitlines() if "error" in line] == [LINE], proc.stderr[-3000:]
    assert proc.stdout == ""
    # Rank 1 waited for rank 0's line (3 s late), not for the wait's limit: that would take the limit on top
    # of the start, however slow the start on a loaded box.
    assert time.monotonic() - t0 < REFUSAL_WAIT_S
