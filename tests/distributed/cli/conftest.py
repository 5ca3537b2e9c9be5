"""The fault-free reference of the failure drills, shared by the relaunch and the in-process drills."""
from __future__ import annotations

import pytest

from tests.distributed.cli.test_drill import DRILL, fault_free_digest


@pytest.fixture(scope="session")
def drill_reference(tmp_path_factory) -> str:
    """The fault-free digest of the DRILL job, checkpointing off: checkpointing must not change training."""
    return fault_free_digest(tmp_path_factory, "drill_ref", DRILL)
