"""A lossless software-failure drill with overlapped data-parallel communication ends bit-identical to its
fault-free run (2 nodes x 2 processes, tp=2 x dp=2, both overlaps on, buckets of 0.02 MiB): the restored shards
and the replayed diffs are the overlapped run's own, and its steps after the restore are too."""
from __future__ import annotations

import pytest

from tests.distributed.cli.test_drill import DRILL, drill, run_job, summary

OVERLAPPED = [*[o for o in DRILL if not o.startswith(("train.iters=", "checkpoint.base_interval="))],
              "train.iters=20", "checkpoint.base_interval=10", "parallel.overlap_grad_reduce=true",
              "parallel.overlap_param_gather=true", "parallel.bucket_mb=0.02"]


@pytest.mark.timeout(600)
def test_software_failure_with_overlap_recovers_bit_identical(tmp_path):
    (tmp_path / "reference").mkdir()
    status, _ = run_job(tmp_path / "reference", [*OVERLAPPED, "checkpoint.enabled=false"], nodes=2, procs=2)
    assert status == 0
    report = drill(tmp_path, "--fail", "software", "--at-step", "16", overrides=OVERLAPPED)
    assert report["ok"], report["stdout"]
    (rec,) = report["recoveries"]
    assert rec["failure_class"] == "software" and rec["end"] >= 10
    assert report["final_digest"] == summary(tmp_path / "reference")["state_digest"]
