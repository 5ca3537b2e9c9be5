"""The MoE benchmark compares like with like: tiny_moe's active parameters are llama_tiny's plus the routers, and
a lossless step's diff record weighs the whole shard (every parameter, routed to or not) in fp32."""
from __future__ import annotations

import pytest

from benchmarks.bench_moe import one_run, table

pytestmark = pytest.mark.timeout(120)


def test_the_moe_and_its_dense_counterpart_are_measured_alike(corpus_prefix, tmp_path):
    runs = {m: one_run(m, "fp32", [f"data.prefix={corpus_prefix}", "data.seq_len=32"], 2, 1, str(tmp_path))
            for m in ("tiny_moe", "llama_tiny")}
    moe, dense = runs["tiny_moe"], runs["llama_tiny"]
    routers = 2 * 4 * 64  # 2 layers of a (4 experts x hidden 64) router
    assert moe["active"] == dense["active"] + routers == dense["params"] + routers < moe["params"]
    assert moe["diff_bytes"] == 4 * moe["params"] and dense["diff_bytes"] == 4 * dense["params"]
    assert "| tiny_moe | 172,864 (123,712) | fp32 |" in table({("tiny_moe", "fp32"): [moe]})
