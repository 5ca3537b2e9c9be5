"""The expert diff benchmark counts the experts a step routed no token to and what their segments weigh."""
from __future__ import annotations

import pytest

from benchmarks.bench_expert_diffs import measure

pytestmark = pytest.mark.timeout(120)


def test_idle_experts_are_counted_and_weighed(corpus_prefix, tmp_path):
    # 16 experts, top-1, 32 tokens a step: some experts get none
    out = measure([f"data.prefix={corpus_prefix}", f"logging.run_dir={tmp_path}", "model=tiny_moe",
                   "model.moe.num_experts=16", "model.moe.top_k=1", "train.global_batch_size=1",
                   "train.micro_batch_size=1", "data.seq_len=32", "checkpoint.diff.compression=fp32"], steps=2)
    assert out["expert_layers"] == 32 and out["idle_expert_steps"] > 0
    # lossless: an idle expert's segments cost their fp32 bytes like any other's
    one_expert_layer = (128 * 64 + 64 * 64) * 4  # gate_up (2 x 64, 64) and proj (64, 64) in fp32
    per_step = out["record_bytes_per_step"] - out["without_idle_bytes_per_step"]
    assert per_step * out["steps"] == pytest.approx(out["idle_expert_steps"] * one_expert_layer, rel=0.01)
