"""The fault campaign, short form: eight kinds of fault through one job, which must end bit-identical."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO
from tools.chaos.catalogue import CATALOGUE
from tools.chaos.s3_proxy import FaultRule

pytestmark = pytest.mark.timeout(420)

SHORT = "crash t1.mid_write,crash replay.mid_batch,node,rack,t1 truncate,t3 flip,s3 resets,stale area"


def test_the_catalogue_covers_every_fault_class_the_campaign_promises():
    assert len(CATALOGUE) >= 20
    for needed in ("node", "rack", "hang", "t1 flip", "t2 flip", "t3 flip", "t3 truncate", "s3 slowdown",
                   "s3 500 one rank", "s3 resets", "s3 full", "t1 full", "stale area", "lease"):
        assert needed in CATALOGUE, needed
    with pytest.raises(ValueError, match="use one of"):
        FaultRule("teapot")


def test_a_short_campaign_survives_every_fault_bit_exactly(tmp_path):
    cmd = [sys.executable, str(REPO / "tools" / "chaos" / "campaign.py"), "--faults", "8", "--seed", "5",
           "--types", SHORT, "--work-dir", str(tmp_path / "campaign")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=400)
    report = proc.stdout
    assert proc.returncode == 0, report[-4000:] + proc.stderr[-3000:]
    assert "8/8 faults recovered as required" in report and "bit-identical" in report
    assert "RESULT: every fault survived or reported" in report
