"""Tokenizers, the indexed dataset, the split and the resumable sampler."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from megatier.data.corpus import build_dataset
from megatier.data.dataset import BatchSource, GPTSamples, ResumableSampler
from megatier.data.indexed import IndexedDataset
from megatier.data.tokenizer import BPETokenizer, ByteTokenizer, train_bpe

TEXTS = ["def add(a, b):\n    return a + b\n", "héllo wörld — ünïcode ✓", "", "class A:\n    pass\n" * 20]


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    for text in TEXTS:
        ids = tok.encode(text)
        assert max(ids, default=0) < 256
        assert tok.decode(ids + [tok.eod_id]) == text


def test_bpe_train_save_load_round_trip(tmp_path):
    path = tmp_path / "tokenizer.json"
    tok = train_bpe(iter(TEXTS * 50), vocab_size=300, path=str(path))
    assert path.exists() and tok.vocab_size <= 300
    loaded = BPETokenizer(str(path))
    for text in TEXTS:
        assert loaded.decode(loaded.encode(text)) == text
    assert loaded.encode(TEXTS[0]) == tok.encode(TEXTS[0])


def test_bpe_missing_file_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        BPETokenizer(str(tmp_path / "missing.json"))


def _write_inputs(tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text(TEXTS[0])
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t}) for t in TEXTS[1:]) + "\n")
    return [str(txt), str(jsonl)]


def test_dataset_preserves_documents(tmp_path):
    prefix = str(tmp_path / "ds")
    build_dataset(_write_inputs(tmp_path), prefix, tokenizer="byte")
    ds = IndexedDataset(prefix)
    tok = ByteTokenizer()
    assert ds.num_documents == len(TEXTS)
    for i, text in enumerate(TEXTS):
        doc = ds.document(i)
        assert doc[-1] == tok.eod_id
        assert tok.decode(doc[:-1].tolist()) == text


def test_dataset_build_is_deterministic(tmp_path):
    inputs = _write_inputs(tmp_path)
    build_dataset(inputs, str(tmp_path / "x"), tokenizer="bpe", bpe_vocab_size=280)
    build_dataset(inputs, str(tmp_path / "y"), tokenizer="bpe", bpe_vocab_size=280)
    assert (tmp_path / "x.bin").read_bytes() == (tmp_path / "y.bin").read_bytes()


def test_bad_jsonl_names_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        build_dataset([str(bad)], str(tmp_path / "out"))
    assert not (tmp_path / "out.idx").exists()  # nothing half-written is left visible


def test_truncated_bin_is_detected(tmp_path, corpus_prefix):
    import shutil

    prefix = str(tmp_path / "copy")
    shutil.copy(corpus_prefix + ".idx", prefix + ".idx")
    with open(corpus_prefix + ".bin", "rb") as src, open(prefix + ".bin", "wb") as dst:
        dst.write(src.read()[:-10])
    with pytest.raises(ValueError, match="truncated"):
        IndexedDataset(prefix)


def test_split_does_not_overlap(corpus_prefix):
    samples = GPTSamples(IndexedDataset(corpus_prefix), seq_len=64, val_fraction=0.1)
    assert samples.num_val > 0
    total = (samples.dataset.num_tokens - 1) // 64
    assert samples.num_train + samples.num_val == total
    first, last = samples.sample(0), samples.sample(total - 1)
    assert len(first) == len(last) == 65


def test_sampler_is_a_permutation_per_epoch():
    sampler = ResumableSampler(num_train=50, seed=3)
    epoch0 = sampler.indices(0, 50)
    epoch1 = sampler.indices(50, 50)
    assert sorted(epoch0) == sorted(epoch1) == list(range(50))
    assert epoch0 != epoch1
    assert ResumableSampler(50, seed=3).indices(0, 50) == epoch0
    assert ResumableSampler(50, seed=4).indices(0, 50) != epoch0


def test_resume_reads_what_an_uninterrupted_run_reads(corpus_prefix):
    samples = GPTSamples(IndexedDataset(corpus_prefix), seq_len=32, val_fraction=0.05)

    def source(dp_rank):
        return BatchSource(samples, ResumableSampler(samples.num_train, seed=7), global_batch_size=8,
                           micro_batch_size=2, dp=2, dp_rank=dp_rank)

    uninterrupted = [source(0).train_microbatches(s) for s in range(1, 13)]
    resumed = source(0)  # a fresh process resuming at step 9 holds no sampler state
    for step in range(9, 13):
        for (x, y), (rx, ry) in zip(uninterrupted[step - 1], resumed.train_microbatches(step)):
            assert np.array_equal(x.numpy(), rx.numpy()) and np.array_equal(y.numpy(), ry.numpy())
    # the two dp ranks read disjoint halves of each global batch
    a = {tuple(x[0].tolist()) for x, _ in source(0).train_microbatches(3)}
    b = {tuple(x[0].tolist()) for x, _ in source(1).train_microbatches(3)}
    assert not a & b


def test_labels_are_inputs_shifted(corpus_prefix):
    samples = GPTSamples(IndexedDataset(corpus_prefix), seq_len=16, val_fraction=0.0)
    x, y = samples.stack([3, 4])
    assert x.shape == y.shape == (2, 16)
    assert np.array_equal(x[:, 1:].numpy(), y[:, :-1].numpy())


def test_a_flipped_byte_in_the_token_file_is_refused_naming_it(tmp_path):
    prefix = str(tmp_path / "ds")
    build_dataset(_write_inputs(tmp_path), prefix, tokenizer="byte")
    clean = IndexedDataset(prefix, cache_dir=str(tmp_path / "cache"))
    assert len(clean.checksum) == 16 and clean.metadata["bin_xxh64"] == clean.checksum
    with open(prefix + ".bin", "r+b") as f:
        f.seek(5)
        byte = f.read(1)
        f.seek(5)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(ValueError, match=r"ds\.bin: xxh64 .* does not match .* rebuild it"):
        IndexedDataset(prefix, cache_dir=str(tmp_path / "cache"))


def test_a_verified_file_is_not_hashed_again_until_it_changes(tmp_path, monkeypatch):
    from megatier.data import indexed

    prefix = str(tmp_path / "ds")
    build_dataset(_write_inputs(tmp_path), prefix, tokenizer="byte")
    calls = []
    real = indexed.file_xxh64
    monkeypatch.setattr(indexed, "file_xxh64", lambda path: calls.append(path) or real(path))
    cache = str(tmp_path / "cache")
    first = IndexedDataset(prefix, cache_dir=cache).checksum
    assert IndexedDataset(prefix, cache_dir=cache).checksum == first and len(calls) == 1
    os.utime(prefix + ".bin", ns=(1, 1))  # a new modification time: verified again
    IndexedDataset(prefix, cache_dir=cache)
    assert len(calls) == 2


def test_preprocess_help_keeps_its_examples_line_by_line(capsys):
    from megatier.cli.preprocess import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert "--vocab-size 8192 \\\n        --output-prefix data/docs" in out
