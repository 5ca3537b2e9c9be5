"""Blends and splits give exactly Megatron-core's GPTDataset + BlendedDataset sample sequences, token for token, for
several seeds, sequence lengths and sample counts, corpora repeating where they hold less than the request."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from megatier.data.megatron_indexed import open_corpus
from megatier.data.megatron_splits import SPLITS, SplitBuilder, parse_blend, split_plans
from megatier.data.source import DataError, build_training_data, megatron_sample_counts
from tests.unit.data.megatron_reference import megatron_sample, megatron_splits, write_corpora, write_corpus

pytestmark = pytest.mark.timeout(300)

SPLIT = "85,10,5"  # 969,30,1-style; every split of the corpora below gets documents


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> list[str]:
    return write_corpora(str(tmp_path_factory.mktemp("megatron_corpora")))


def _ours(blend, split, per_split, sizes, seq_len, seed, cache_dir):
    builder = SplitBuilder(lambda prefix: open_corpus(prefix, cache_dir), seq_len, seed, 0.005)
    plans = split_plans(blend, split, per_split)
    return [builder.build(plans[name], size) if plans[name] else None for name, size in zip(SPLITS, sizes)]


def _assert_same_sequences(ours: list, theirs: list) -> None:
    for name, mine, reference in zip(SPLITS, ours, theirs):
        assert (mine is None) == (reference is None), name
        if reference is None:
            continue
        assert len(mine) == len(reference), name
        for i in range(len(reference)):
            assert np.array_equal(mine.sample(i), megatron_sample(reference, i)), (name, i)


def _weighted(prefixes: list[str], weights: list[float]) -> list:
    return [item for weight, prefix in zip(weights, prefixes) for item in (weight, prefix)]


@pytest.mark.parametrize("seed", [1, 1234])
@pytest.mark.parametrize("seq_len,sizes", [(8, [120, 20, 8]), (33, [90, 12, 6]), (8, [900, 60, 16])])
def test_a_weighted_blend_gives_megatrons_train_valid_and_test_samples(corpora, tmp_path, seed, seq_len, sizes):
    weights = [0.3, 0.5, 0.2]
    theirs = megatron_splits((corpora, weights), SPLIT, sizes, seq_len, seed)
    ours = _ours(_weighted(corpora, weights), SPLIT, {}, sizes, seq_len, seed, str(tmp_path))
    _assert_same_sequences(ours, theirs)
    if sizes[0] == 900:  # the request exceeds the corpora: their documents repeat
        assert any(part.epochs > 1 for part in ours[0].parts)


@pytest.mark.parametrize("seed", [3, 99])
def test_a_blend_without_weights_weighs_the_corpora_by_size(corpora, tmp_path, seed):
    sizes = [150, 10, 5]
    theirs = megatron_splits((corpora, None), SPLIT, sizes, 16, seed)
    _assert_same_sequences(_ours(list(corpora), SPLIT, {}, sizes, 16, seed, str(tmp_path)), theirs)


@pytest.mark.parametrize("weighted", [False, True])
def test_one_corpus_is_megatrons_single_dataset(corpora, tmp_path, weighted):
    sizes = [300, 15, 5]
    blend = ([corpora[0]], [1.0] if weighted else None)
    theirs = megatron_splits(blend, SPLIT, sizes, 8, 5)
    ours = _ours(_weighted(*blend) if weighted else [corpora[0]], SPLIT, {}, sizes, 8, 5, str(tmp_path))
    _assert_same_sequences(ours, theirs)


def test_blends_per_split_give_megatrons_samples(corpora, tmp_path):
    sizes = [200, 30, 12]
    per_split = [(corpora, [2.0, 1.0, 1.0]), ([corpora[2]], None), (corpora[:2], None)]
    theirs = megatron_splits(None, None, sizes, 12, 42, per_split=per_split)
    ours = _ours(None, None, {"train": _weighted(*per_split[0]), "valid": [corpora[2]], "test": corpora[:2]},
                 sizes, 12, 42, str(tmp_path))
    _assert_same_sequences(ours, theirs)


def test_the_969_30_1_split_of_large_corpora(tmp_path):
    rng = np.random.default_rng(7)
    prefixes = []
    for i, count in enumerate((1200, 700)):
        prefix = str(tmp_path / f"big{i}")
        write_corpus(prefix, [rng.integers(0, 50000, size=int(rng.integers(1, 12))).tolist() for _ in range(count)],
                     np.uint16)
        prefixes.append(prefix)
    sizes = [500, 40, 10]
    theirs = megatron_splits((prefixes, [0.7, 0.3]), "969,30,1", sizes, 16, 1234)
    _assert_same_sequences(_ours([0.7, prefixes[0], 0.3, prefixes[1]], "969,30,1", {}, sizes, 16, 1234,
                                 str(tmp_path)), theirs)


def _config(blend, split, **train):
    d = SimpleNamespace(prefix=None, blend=blend, split=split, train_blend=None, valid_blend=None, test_blend=None,
                        mid_level_dataset_surplus=0.005, cache_dir=None, seq_len=8, seed=11, train_samples=None)
    t = SimpleNamespace(**{"iters": 6, "global_batch_size": 8, "micro_batch_size": 2, "eval_interval": 3,
                           "eval_iters": 2, "rampup_batch_size": None, **train})
    return d, t


def test_the_trainers_global_sample_k_is_megatrons_training_sample_k(corpora, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATIER_CACHE", str(tmp_path))
    d, t = _config(_weighted(corpora, [0.5, 0.25, 0.25]), SPLIT)
    counts = megatron_sample_counts(t)
    assert counts == {"train": 48, "valid": 48, "test": 16}
    train, valid, _ = megatron_splits((corpora, [0.5, 0.25, 0.25]), SPLIT, list(counts.values()), 8, 11)
    ranks = [build_training_data(d, t, SimpleNamespace(rank=r, dp=2, dp_rank=r, checkpoint_group=None),
                                 joining=False, vocab_size=70000) for r in range(2)]
    assert ranks[0].checksum == ranks[1].checksum and ranks[0].metadata["vocab_size"] == 70000
    for step in range(1, t.iters + 1):
        rows = [np.concatenate([inputs.numpy(), labels.numpy()[:, -1:]], axis=1)
                for data in ranks for inputs, labels in data.batches.train_microbatches(step)]
        first = (step - 1) * t.global_batch_size
        expected = [megatron_sample(train, k) for k in range(first, first + t.global_batch_size)]
        assert np.array_equal(np.concatenate(rows), np.stack(expected)), step
    inputs, _ = ranks[0].batches.val_microbatches(1)[0]
    assert np.array_equal(inputs.numpy()[0], megatron_sample(valid, 0)[:-1])  # validation reads the valid split


def test_data_train_samples_sizes_the_order_as_megatrons_train_samples(corpora, tmp_path, monkeypatch):
    # Megatron's --train-samples 80: the blend built for 80 samples, whatever train.iters (6 x 8) reads of it.
    monkeypatch.setenv("MEGATIER_CACHE", str(tmp_path))
    d, t = _config(_weighted(corpora, [0.5, 0.25, 0.25]), SPLIT, micro_batch_size=8)
    d.train_samples = 80
    counts = megatron_sample_counts(t, d.train_samples)
    assert counts["train"] == 80
    train, _, _ = megatron_splits((corpora, [0.5, 0.25, 0.25]), SPLIT, list(counts.values()), 8, 11)
    data = build_training_data(d, t, SimpleNamespace(rank=0, dp=1, dp_rank=0, checkpoint_group=None),
                               joining=False, vocab_size=70000)
    inputs, labels = data.batches.train_microbatches(6)[0]
    rows = np.concatenate([inputs.numpy(), labels.numpy()[:, -1:]], axis=1)
    assert np.array_equal(rows, np.stack([megatron_sample(train, k) for k in range(40, 48)]))
    assert len(train) != len(megatron_splits((corpora, [0.5, 0.25, 0.25]), SPLIT, [48, 48, 16], 8, 11)[0])


def test_the_checksum_covers_every_corpus_and_the_weights(corpora, tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATIER_CACHE", str(tmp_path))
    reader = SimpleNamespace(rank=0, dp=1, dp_rank=0, checkpoint_group=None)

    def checksum(blend):
        d, t = _config(blend, SPLIT, micro_batch_size=8)
        return build_training_data(d, t, reader, joining=False, vocab_size=70000).checksum

    base = checksum(_weighted(corpora, [0.3, 0.5, 0.2]))
    assert checksum(_weighted(corpora, [0.3, 0.5, 0.2])) == base
    assert checksum(_weighted(corpora, [0.5, 0.3, 0.2])) != base
    assert checksum(_weighted(corpora[:2], [0.3, 0.5])) != base
    write_corpus(str(tmp_path / "changed"), [[9, 9, 9]] * 30, np.uint16)
    assert checksum(_weighted([*corpora[:2], str(tmp_path / "changed")], [0.3, 0.5, 0.2])) != base


def test_a_split_without_documents_is_one_line_not_a_hang(corpora, tmp_path):
    builder = SplitBuilder(lambda prefix: open_corpus(prefix, str(tmp_path)), 8, 1, 0.005)
    plan = split_plans([corpora[2]], "969,30,1", {})["test"]  # 25 documents: the test share rounds to none
    with pytest.raises(ValueError, match=r"gives the test split of .*corpus2 none of its 25 documents"):
        builder.build(plan, 10)
    empty = str(tmp_path / "empty")
    write_corpus(empty, [[], [], [1, 2, 3]], np.uint16)
    with pytest.raises(ValueError, match=r"the train split of .*empty has no tokens in its 2 documents"):
        builder.build(split_plans([empty], "2,1", {})["train"], 10)
    d, t = _config([corpora[2]], "0,1,0")
    with pytest.raises(DataError, match="gives the train split no documents"):
        build_training_data(d, t, SimpleNamespace(rank=0, dp=1, dp_rank=0, checkpoint_group=None), joining=False,
                            vocab_size=70000)


@pytest.mark.parametrize("blend,message", [([], "empty"), ([0.5, "a", "b", "c"], "mixes weights and prefixes"),
                                           ([0, "a", 1, "b"], "must be positive")])
def test_a_malformed_blend_says_what_is_wrong(blend, message):
    with pytest.raises(ValueError, match=message):
        parse_blend(blend)
