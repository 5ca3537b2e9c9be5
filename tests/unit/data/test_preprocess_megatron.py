"""megatier-preprocess writes what megatron-core's IndexedDatasetBuilder writes for the same token ids (fed as
Megatron-LM's tools/preprocess_data.py --append-eod feeds it), from JSON lines (plain, .gz, .zst) and parquet, and
the same bytes for any number of workers."""
from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from megatier.cli.preprocess import main as preprocess
from megatier.data.corpus import build_dataset
from megatier.data.megatron_indexed import MegatronIndexedDataset
from megatier.data.tokenizer import ByteTokenizer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _checksum_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATIER_CACHE", str(tmp_path / "cache"))

TEXTS = ["The first document.\n", "", "x", "ünïcødé ✓ and tabs\tand newlines\n\n",
         *(f"document {i}: " + "words " * (i % 13) for i in range(150))]


def megatron_reference(prefix: str, texts: list[str], tokenizer, dtype) -> None:
    """The corpus Megatron-LM's preprocess_data.py --append-eod writes: its Encoder's ids, its builder's files."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for text in texts:
        ids = tokenizer.encode(text)
        lengths = []
        if ids:
            ids = ids + [tokenizer.eod_id]
            lengths = [len(ids)]
        builder.add_document(torch.tensor(ids, dtype=torch.int64), lengths)
    builder.finalize(prefix + ".idx")


def write_jsonl(path, texts: list[str], key: str = "text") -> str:
    path.write_text("".join(json.dumps({key: t, "id": i}) + "\n" for i, t in enumerate(texts)))
    return str(path)


def write_parquet(path, texts: list[str], key: str = "text") -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(texts))), key: texts}), str(path), row_group_size=37)
    return str(path)


def same_files(a: str, b: str) -> bool:
    return all(open(a + s, "rb").read() == open(b + s, "rb").read() for s in (".bin", ".idx"))


@pytest.fixture
def reference(tmp_path):
    prefix = str(tmp_path / "reference")
    megatron_reference(prefix, TEXTS, ByteTokenizer(), np.uint16)
    return prefix


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_jsonl_and_parquet_give_megatron_cores_bytes(tmp_path, reference, kind):
    source = (write_jsonl(tmp_path / "docs.jsonl", TEXTS) if kind == "jsonl"
              else write_parquet(tmp_path / "docs.parquet", TEXTS))
    out = str(tmp_path / "out")
    assert preprocess(["--input", source, "--output-prefix", out, "--chunk-documents", "7"]) == 0
    assert same_files(out, reference)
    corpus = MegatronIndexedDataset(out, cache_dir=str(tmp_path / "cache"))
    assert corpus.num_documents == len(TEXTS)
    assert corpus.num_sequences == sum(1 for t in TEXTS if t)


def test_two_workers_write_the_same_bytes_as_one(tmp_path):
    sources = [write_jsonl(tmp_path / "a.jsonl", TEXTS), write_parquet(tmp_path / "b.parquet", TEXTS[::-1])]
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    assert preprocess(["--input", *sources, "--output-prefix", one, "--workers", "1"]) == 0
    assert preprocess(["--input", *sources, "--output-prefix", two, "--workers", "2", "--chunk-documents", "3"]) == 0
    assert same_files(one, two)


def test_compressed_jsonl_reads_as_plain(tmp_path, reference):
    import zstandard

    plain = (tmp_path / "p.jsonl")
    write_jsonl(plain, TEXTS)
    (tmp_path / "g.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes()))
    (tmp_path / "z.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
    for name in ("g.jsonl.gz", "z.jsonl.zst"):
        out = str(tmp_path / name.split(".")[0])
        assert preprocess(["--input", str(tmp_path / name), "--output-prefix", out]) == 0
        assert same_files(out, reference), name


def test_without_append_eod_documents_are_their_tokens(tmp_path):
    out = str(tmp_path / "out")
    assert preprocess(["--input", write_jsonl(tmp_path / "d.jsonl", TEXTS), "--output-prefix", out,
                       "--no-append-eod"]) == 0
    corpus = MegatronIndexedDataset(out, cache_dir=str(tmp_path / "cache"))
    tokenizer = ByteTokenizer()
    texts = [t for t in TEXTS if t]
    assert [tokenizer.decode(corpus.get(i).tolist()) for i in range(corpus.num_sequences)] == texts
    assert tokenizer.eod_id not in np.asarray(corpus.tokens)


def test_megatier_format_is_what_build_dataset_writes(tmp_path):
    """The flag keeps MegaTier's own format, byte for byte as before (every document ends with the EOD)."""
    sources = [write_jsonl(tmp_path / "a.jsonl", TEXTS), __file__]
    ours, before = str(tmp_path / "ours"), str(tmp_path / "before")
    assert preprocess(["--input", *sources, "--output-prefix", ours, "--output-format", "megatier",
                       "--workers", "2"]) == 0
    build_dataset(sources, before, tokenizer="byte")
    assert same_files(ours, before)


def test_a_large_vocabulary_is_stored_as_int32_as_megatron_does(tmp_path):
    from megatier.data.megatron_writer import MegatronCorpusWriter, megatron_token_dtype

    assert megatron_token_dtype(65499) == np.uint16 and megatron_token_dtype(65500) == np.int32
    documents = [[70000, 1, 2], [], [5]]
    reference = str(tmp_path / "reference")
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(reference + ".bin", dtype=np.int32)
    for ids in documents:
        builder.add_document(torch.tensor(ids, dtype=torch.int64), [len(ids)] if ids else [])
    builder.finalize(reference + ".idx")
    writer = MegatronCorpusWriter(str(tmp_path / "ours"), np.dtype(np.int32))
    writer.add_documents(np.asarray([t for d in documents for t in d], np.int32), np.asarray([3, 0, 1]))
    writer.close()
    assert same_files(str(tmp_path / "ours"), reference)
