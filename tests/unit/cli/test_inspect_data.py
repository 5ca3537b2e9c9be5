"""megatier-inspect data (megatier/cli/inspect_data.py, megatier/data/report.py): the samples it reports are
Megatron-core's GPTDataset + BlendedDataset samples, token for token; the proportions and epochs are the blend's;
bad overrides are one line and exit 2."""
from __future__ import annotations

import json

import numpy as np
import pytest

from megatier.cli.inspect import main
from megatier.data.report import DataReport
from megatier.data.source import megatron_sample_counts
from tests.unit.data.megatron_reference import megatron_sample, megatron_splits, write_corpora

pytestmark = pytest.mark.timeout(300)

SPLIT = "85,10,5"
WEIGHTS = [0.3, 0.5, 0.2]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> list[str]:
    return write_corpora(str(tmp_path_factory.mktemp("megatron_corpora")))


def _overrides(corpora, tmp_path, seq_len: int, seed: int, iters: int) -> list[str]:
    blend = ",".join(f"{w},{p}" for w, p in zip(WEIGHTS, corpora))
    return ["model=tiny", "model.vocab_size=65536", f"data.blend=[{blend}]", f"data.split={SPLIT.replace(',', '/')}",
            f"data.seq_len={seq_len}", f"data.seed={seed}", f"data.cache_dir={tmp_path}", f"train.iters={iters}",
            "train.global_batch_size=4", "train.micro_batch_size=2", "train.eval_interval=5", "train.eval_iters=1"]


def _inspect(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["data", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("seq_len,seed,iters", [(8, 1234, 30), (16, 7, 200)])  # 200 x 4: corpora repeat
def test_json_reports_megatrons_tokens(corpora, tmp_path, capsys, seq_len, seed, iters):
    overrides = _overrides(corpora, tmp_path, seq_len, seed, iters)
    code, out, _ = _inspect(capsys, "--json", "--samples", "0:40", "--", *overrides)
    assert code == 0
    report = json.loads(out)
    counts = megatron_sample_counts(type("T", (), {"iters": iters, "global_batch_size": 4, "eval_interval": 5,
                                                   "eval_iters": 1})())
    train, valid, _ = megatron_splits((corpora, WEIGHTS), SPLIT, [counts["train"], counts["valid"], counts["test"]],
                                      seq_len, seed)
    for s in report["samples"]:
        assert s["tokens"] == megatron_sample(train, s["index"]).tolist(), s["index"]
    code, out, _ = _inspect(capsys, "--json", "--split", "valid", "--samples", "0:3", "--", *overrides)
    for s in json.loads(out)["samples"]:
        assert s["tokens"] == megatron_sample(valid, s["index"]).tolist()
    splits = {s["name"]: s for s in report["splits"]}
    assert splits["train"]["samples"] == len(train) and splits["train"]["requested"] == counts["train"]
    parts = splits["train"]["parts"]
    assert [p["requested"] for p in parts] == pytest.approx(WEIGHTS)
    assert sum(p["samples"] for p in parts) == len(train)
    assert [p["realized"] for p in parts] == pytest.approx(WEIGHTS, abs=0.02)
    if iters == 200:
        assert max(p["epochs"] for p in parts) > 1  # the smallest corpus is read more than once
    rows = {c["prefix"]: c for c in report["corpora"]}
    assert [rows[p]["format"] for p in corpora] == ["megatron"] * 3
    assert [rows[p]["dtype"] for p in corpora] == ["uint16", "int32", "uint16"]


def test_the_table_and_the_default_corpus(corpora, tmp_path, capsys, corpus_prefix):
    code, out, _ = _inspect(capsys, "--", *_overrides(corpora, tmp_path, 8, 1, 30))
    assert code == 0
    assert "requested" in out and "realized" in out and "epochs" in out and "30.00%" in out
    assert "(token ids: the corpus records no tokenizer)" in out
    code, out, _ = _inspect(capsys, "--samples", "0:2", "--", "model=tiny", f"data.prefix={corpus_prefix}",
                            "train.iters=3")
    assert code == 0 and "data: data.prefix" in out and "train samples 0:2" in out


def test_a_prefix_sample_is_the_one_the_first_step_reads(corpus_prefix, compose_config):
    from megatier.data.dataset import BatchSource, GPTSamples, ResumableSampler
    from megatier.data.megatron_indexed import open_corpus

    cfg = compose_config("model=tiny", f"data.prefix={corpus_prefix}", "train.iters=3")
    report = DataReport(cfg.data, cfg.train)
    samples = GPTSamples(open_corpus(corpus_prefix), cfg.data.seq_len, cfg.data.val_fraction)
    source = BatchSource(samples, ResumableSampler(samples.num_train, cfg.data.seed),
                         global_batch_size=cfg.train.global_batch_size, micro_batch_size=cfg.train.micro_batch_size,
                         dp=1, dp_rank=0)
    x, y = source.train_microbatches(1)[0]
    want = np.concatenate([x[0].numpy(), y[0, -1:].numpy()])
    assert np.array_equal(report.sample("train", 0).tokens, want)


@pytest.mark.parametrize("argv,line", [
    (["--", "model=tiny", "data.prefix=/nowhere/corpus"], "data.prefix='/nowhere/corpus'"),
    (["--", "model=tiny", "data.nonsense=1"], "data.nonsense"),
    (["--split", "test", "--", "model=tiny", "data.prefix=PREFIX"], "no test split"),
])
def test_bad_overrides_are_one_line_and_exit_2(capsys, corpus_prefix, argv, line):
    code, _, err = _inspect(capsys, *[a.replace("PREFIX", corpus_prefix) for a in argv])
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("megatier-inspect data: error:")
    assert line in err


def test_a_bad_sample_range_is_an_argument_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["data", "--samples", "5:2", "--", "model=tiny"])
    assert exit_.value.code == 2 and "give e.g. 0:8" in capsys.readouterr().err
