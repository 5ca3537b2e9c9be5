"""The fault-free reference of the failure drills, shared by the relaunch and the in-process drills."""
from __future__ import annotations

import pytest

from tests.distributed.cli.test_drill import DRILL, run_job, summary


@pytest.fixture(scope="session")
def drill_reference(tmp_path_factory) -> str:
    """The fault-free digest of the DRILL job, checkpointing off: checkpointing must not change training."""
    work = tmp_path_factory.mktemp("drill_ref")
    status, _ = run_job(work, [*DRILL, "checkpoint.enabled=false"], nodes=2, procs=2)
    assert status == 0
    return summary(work)["state_digest"]
