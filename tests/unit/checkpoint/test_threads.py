"""Checkpoint helper threads stay off the training loop's cores: one OpenMP thread, lowest priority."""
import os
import threading

import pytest
import torch

from megatier import ops
from megatier.checkpoint.threads import HELPER_NICENESS, helper_thread


def _observe() -> dict:
    tid = threading.get_native_id()
    return {"threads": torch.get_num_threads(), "nice": os.getpriority(os.PRIO_PROCESS, tid)}


def test_helper_thread_runs_demoted_and_leaves_the_caller_alone():
    before = _observe()
    seen = {}
    thread = helper_thread(lambda: seen.update(_observe()), "megatier-test-helper")
    assert thread.daemon and thread.name == "megatier-test-helper"
    thread.start()
    thread.join(timeout=30)
    assert seen["nice"] == max(before["nice"], HELPER_NICENESS)
    if ops.native_info().get("openmp"):
        assert seen["threads"] == 1
    assert _observe() == before  # the nice value and the OpenMP team size are per thread


@pytest.mark.skipif(not ops.native_available(), reason="needs the compiled extension")
def test_limit_thread_parallelism_rejects_zero():
    result = {}

    def body():
        try:
            ops.limit_thread_parallelism(0)
        except RuntimeError as e:
            result["error"] = str(e)

    t = threading.Thread(target=body)
    t.start()
    t.join(timeout=30)
    assert "must be >= 1" in result["error"]
