"""Lossless failure drills with overlapped data-parallel communication end bit-identical to their fault-free run
(2 nodes x 2 processes, tp=2 x dp=2, both overlaps on, buckets of 0.02 MiB): after a relaunch, and recovered in
place by a hot spare, whose survivors drop the bucket collectives in flight on the failed world."""
from __future__ import annotations

import pytest

from tests.distributed.cli.test_drill import DRILL, drill, fault_free_digest

OVERLAPPED = [*[o for o in DRILL if not o.startswith(("train.iters=", "checkpoint.base_interval="))],
              "train.iters=20", "checkpoint.base_interval=10", "parallel.overlap_grad_reduce=true",
              "parallel.overlap_param_gather=true", "parallel.bucket_mb=0.02"]


@pytest.fixture(scope="module")
def overlapped_reference(tmp_path_factory) -> str:
    return fault_free_digest(tmp_path_factory, "overlap_ref", OVERLAPPED)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_software_failure_with_overlap_recovers_bit_identical(tmp_path, overlapped_reference):
    report = drill(tmp_path, "--fail", "software", "--at-step", "16", overrides=OVERLAPPED)
    assert report["ok"], report["stdout"]
    (rec,) = report["recoveries"]
    assert rec["failure_class"] == "software" and rec["end"] >= 10
    assert report["final_digest"] == overlapped_reference


@pytest.mark.timeout(600)
def test_in_place_recovery_with_overlap_is_bit_identical(tmp_path, overlapped_reference):
    report = drill(tmp_path, "--recovery", "inprocess", "--fail", "software", "--at-step", "12", overrides=OVERLAPPED)
    assert report["ok"] and report["returncode"] == 0, report["stdout"]
    (rec,) = report["recoveries"]
    assert rec["end"] == 12 and rec["ranks_in_place"] == [0, 1, 2], rec
    assert report["final_digest"] == overlapped_reference
