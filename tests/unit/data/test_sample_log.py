"""The sample log's reading: a step's newest take counts, share by share, whatever layout took it before."""
from __future__ import annotations

import json

from megatier.data.sample_log import SampleLog, consumed_by_step


def _write(folder, name, entries):
    (folder / f"samples.{name}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))


def test_the_newest_take_of_each_share_counts(tmp_path):
    # Step 5 taken by a world of dp=4 (one share read, then the job failed), then by dp=2 after the recovery; a
    # tensor-parallel peer logs the same share again.
    _write(tmp_path, "1", [{"t": 1.0, "step": 5, "dp": 4, "dp_rank": 3, "samples": [99]},
                           {"t": 3.0, "step": 5, "dp": 2, "dp_rank": 0, "samples": [8, 9]}])
    _write(tmp_path, "2", [{"t": 3.1, "step": 5, "dp": 2, "dp_rank": 1, "samples": [10, 11]},
                           {"t": 3.2, "step": 5, "dp": 2, "dp_rank": 1, "samples": [10, 11]},
                           {"t": 2.0, "step": 4, "dp": 4, "dp_rank": 0, "samples": [4]}])
    assert consumed_by_step(tmp_path) == {4: [4], 5: [8, 9, 10, 11]}


def test_a_disabled_log_writes_nothing_and_an_enabled_one_whole_lines(tmp_path):
    off = SampleLog.from_env({})
    off.consumed(1, 1, 0, [1])
    assert not off.enabled and not list(tmp_path.iterdir())
    on = SampleLog.from_env({"MEGATIER_SAMPLE_LOG": str(tmp_path / "log")})
    on.consumed(1, 2, 1, [3, 4])
    on.consumed(2, 2, 1, [7, 8])
    assert consumed_by_step(tmp_path / "log") == {1: [3, 4], 2: [7, 8]}  # dp=2 with one share: what was taken
