"""Megatron's .bin/.idx read as it is: corpora written by megatron-core's own builder, every dtype, documents as
Megatron defines them, the checksum computed once per file version, and the format chosen by the magic."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from megatier.data import indexed
from megatier.data.corpus import build_dataset
from megatier.data.indexed import IndexedDataset
from megatier.data.megatron_indexed import DTYPES, MegatronIndexedDataset, index_format, open_corpus
from tests.unit.data.megatron_reference import random_documents, write_corpus

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_a_corpus_written_by_megatron_is_read_token_for_token(tmp_path, dtype):
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronReader

    documents = random_documents(np.random.default_rng(1), 50, 65535)
    prefix = str(tmp_path / "corpus")
    write_corpus(prefix, documents, dtype)
    ours, theirs = MegatronIndexedDataset(prefix, cache_dir=str(tmp_path / "cache")), MegatronReader(prefix)
    assert ours.dtype == np.dtype(dtype)
    assert ours.num_sequences == len(documents) == ours.num_documents
    assert np.array_equal(ours.sequence_lengths, theirs.sequence_lengths)
    assert np.array_equal(ours.document_indices, theirs.document_indices)
    for i, document in enumerate(documents):
        assert ours.get(i).tolist() == document == theirs[i].tolist()
        assert ours.get(i, 1, 2).tolist() == theirs.get(i, offset=1, length=2).tolist()
    assert ours.get(3).size == 0 and ours.get(5).size == 1  # the empty and the one-token document
    assert ours.num_tokens == sum(map(len, documents))


@pytest.mark.parametrize("code", sorted(DTYPES))
def test_every_dtype_code_reads_its_values(tmp_path, code):
    dtype = DTYPES[code]
    prefix = str(tmp_path / "corpus")
    write_corpus(prefix, [[1, 2, 3], [], [4], [5, 6]], dtype)
    corpus = MegatronIndexedDataset(prefix, cache_dir=str(tmp_path / "cache"))
    assert corpus.dtype == np.dtype(dtype)
    assert [corpus.get(i).tolist() for i in range(4)] == [[1, 2, 3], [], [4], [5, 6]]


def test_a_document_of_several_sequences_is_one_document(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    builder.add_document(torch.tensor([1, 2, 3, 4, 5]), lengths=[2, 3])
    builder.add_document(torch.tensor([6]), lengths=[1])
    builder.finalize(prefix + ".idx")
    corpus = MegatronIndexedDataset(prefix, cache_dir=str(tmp_path / "cache"))
    assert (corpus.num_sequences, corpus.num_documents) == (3, 2)
    assert corpus.document(0).tolist() == [1, 2, 3, 4, 5] and corpus.document(1).tolist() == [6]
    assert corpus.get(1).tolist() == [3, 4, 5]


def test_the_checksum_is_computed_once_per_file_version(tmp_path, monkeypatch):
    prefix = str(tmp_path / "corpus")
    write_corpus(prefix, [[1, 2, 3], [4, 5]], np.uint16)
    cache = str(tmp_path / "cache")
    hashed = []
    real = indexed.file_xxh64
    monkeypatch.setattr(indexed, "file_xxh64", lambda path: hashed.append(path) or real(path))
    first = MegatronIndexedDataset(prefix, cache_dir=cache).checksum
    assert sorted(hashed) == [prefix + ".bin", prefix + ".idx"]
    assert MegatronIndexedDataset(prefix, cache_dir=cache).checksum == first
    assert len(hashed) == 2  # remembered: the second open read no file whole
    write_corpus(prefix, [[1, 2, 3], [4, 6]], np.uint16)  # same sizes, other tokens
    os.utime(prefix + ".bin", ns=(1, 1))
    assert MegatronIndexedDataset(prefix, cache_dir=cache).checksum != first


def test_the_format_is_chosen_by_the_magic(tmp_path):
    megatron, own = str(tmp_path / "megatron"), str(tmp_path / "own")
    write_corpus(megatron, [[1, 2], [3]], np.int32)
    build_dataset([__file__], own, tokenizer="byte")
    assert (index_format(megatron + ".idx"), index_format(own + ".idx")) == ("megatron", "megatier")
    assert isinstance(open_corpus(megatron, str(tmp_path / "cache")), MegatronIndexedDataset)
    assert isinstance(open_corpus(own, str(tmp_path / "cache")), IndexedDataset)
    with open(str(tmp_path / "junk.idx"), "wb") as f:
        f.write(b"NOTANIDX" * 4)
    with pytest.raises(ValueError, match="neither a Megatron"):
        index_format(str(tmp_path / "junk.idx"))


def test_a_truncated_bin_is_refused(tmp_path):
    prefix = str(tmp_path / "corpus")
    write_corpus(prefix, [[1, 2, 3], [4, 5]], np.int32)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(12)
    with pytest.raises(ValueError, match="truncated or mismatched"):
        MegatronIndexedDataset(prefix, cache_dir=str(tmp_path / "cache"))


def test_data_prefix_reads_a_megatron_corpus_in_megatiers_own_order(tmp_path):
    from megatier.data.dataset import GPTSamples

    prefix = str(tmp_path / "corpus")
    documents = random_documents(np.random.default_rng(2), 20, 500)
    write_corpus(prefix, documents, np.int32)
    samples = GPTSamples(open_corpus(prefix, str(tmp_path / "cache")), seq_len=7, val_fraction=0.1)
    stream = [token for document in documents for token in document]
    assert samples.num_train + samples.num_val == (len(stream) - 1) // 7
    for i in (0, 3, samples.num_train):
        assert samples.sample(i).tolist() == stream[i * 7:i * 7 + 8]
