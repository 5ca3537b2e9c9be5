"""The GPU check's throughput phase (tools/gpu/throughput.py) on the CPU with a tiny model: the plain baseline is
the same model as MegaTier's (equal parameter counts, and GPT-2 small's 124M at its shape), and MFU is tokens/s
times 6 N + 12 L h s over the peak."""
from __future__ import annotations

import json

import pytest
import torch

from tools.gpu.throughput import PlainGPT2, flops_per_token, main

pytestmark = pytest.mark.timeout(180)


def test_the_plain_model_at_gpt2_small_s_shape_has_its_124m_parameters():
    with torch.device("meta"):
        model = PlainGPT2(vocab=50257, layers=12, hidden=768, heads=12, ffn=3072, positions=1024, dropout=0.1)
    assert sum(p.numel() for p in model.parameters()) == 124_439_808


def test_megatier_and_the_plain_loop_train_the_same_model(corpus_prefix, tmp_path):
    out = tmp_path / "throughput.json"
    assert main(["--model", "tiny", "--precision", "fp32", "--seq", "32", "--batch", "2", "--steps", "3",
                 "--warmup", "1", "--device", "cpu", "--rows", "plain,megatier", "--peak-tflops", "0.5",
                 "--json", str(out), "--", f"data.prefix={corpus_prefix}",
                 f"logging.run_dir={tmp_path / 'run'}"]) == 0
    plain, megatier = json.loads(out.read_text())["rows"]
    assert (plain["row"], megatier["row"]) == ("plain", "megatier")
    assert plain["params"] == megatier["params"] > 0
    for row in (plain, megatier):
        assert row["tokens_per_s"] > 0
        assert row["mfu"] == pytest.approx(row["tokens_per_s"] * row["flops_per_token"] / 0.5e12)
    assert megatier["flops_per_token"] == flops_per_token(megatier["params"], 128 * 64, 2, 64, 32)  # model=tiny
