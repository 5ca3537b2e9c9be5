"""What a training job reads: its batches, the checksum of its data, the data's metadata, from the data config.

Two ways to name data:
- ``data.prefix`` (or nothing: the default corpus): one corpus, MegaTier's
  sample order (megatier.data.dataset), the last ``data.val_fraction`` of
  samples for validation;
- ``data.blend`` with ``data.split``, or ``data.train_blend`` / ``valid_blend`` /
  ``test_blend``: Megatron's blends and splits (megatier.data.megatron_splits),
  so that training sample k is Megatron-core's training sample k for the same
  seed, sequence length, blend, split and sample counts, and validation reads
  the valid split.
Either way the sample read at any point is a pure function of the number of
samples consumed before it, which is what keeps resume and resharding exact.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import numpy as np
import torch
import torch.distributed as dist
import xxhash

from megatier.data.blend import Samples
from megatier.data.corpus import ensure_default_corpus
from megatier.data.dataset import BatchSource, GPTSamples, ResumableSampler
from megatier.data.megatron_indexed import Corpus, MegatronIndexedDataset, open_corpus
from megatier.data.megatron_splits import SplitBuilder, split_plans

log = logging.getLogger(__name__)


class DataError(ValueError):
    """The configured data cannot give what the job asks of it (one line naming the corpus and the fix)."""


class Reader(Protocol):
    """The process that reads: its rank, its data-parallel place, and the group that shares the default corpus."""

    rank: int
    dp: int
    dp_rank: int
    checkpoint_group: object


@dataclass
class TrainingData:
    batches: BatchSource
    checksum: str  # enters the job's fingerprint: every corpus file read, and how they are blended
    metadata: dict  # the tokenizer's record (vocab_size at least)
    prefix: Optional[str]  # the single corpus's prefix; None for a blend


def uses_megatron_splits(d) -> bool:
    return any(b is not None for b in (d.blend, d.train_blend, d.valid_blend, d.test_blend))


def megatron_sample_counts(t, train_samples: Optional[int] = None) -> dict[str, int]:
    """Megatron's requested samples per split: training ``train_samples`` (data.train_samples, as
    --train-samples) or iterations x global batch; validation (iters // eval_interval + 1) x eval_iters x global
    batch; test eval_iters x global batch."""
    batch = t.global_batch_size
    return {"train": train_samples or t.iters * batch,
            "valid": (t.iters // t.eval_interval + 1) * t.eval_iters * batch, "test": t.eval_iters * batch}


def build_training_data(d, t, reader: Reader, *, joining: bool, vocab_size: Optional[int]) -> TrainingData:
    """The job's data (``d``: DataConfig, ``t``: TrainConfig); ``joining``: a spare joining a re-formed job;
    ``vocab_size``: model.vocab_size, the vocabulary of corpora that record none (Megatron's)."""
    try:
        if uses_megatron_splits(d):
            return _megatron_data(d, t, reader, vocab_size)
        return _prefix_data(d, t, reader, joining, vocab_size)
    except (FileNotFoundError, ValueError) as e:
        raise DataError(str(e)) from None


def _batches(samples, sampler, t, reader: Reader) -> BatchSource:
    return BatchSource(samples, sampler, global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size,
                       dp=reader.dp, dp_rank=reader.dp_rank, rampup=t.rampup_batch_size)


def _prefix_data(d, t, reader: Reader, joining: bool, vocab_size: Optional[int]) -> TrainingData:
    prefix = d.prefix
    # A spare joining a re-formed job finds the corpus rank 0 made at the launch (the survivors build no data,
    # so there is nobody to broadcast with).
    if prefix is None:
        if reader.rank == 0 or joining:
            prefix = ensure_default_corpus(d.cache_dir, d.tokenizer, d.default_corpus_mib, d.bpe_vocab_size)
        if not joining:
            holder = [prefix]
            dist.broadcast_object_list(holder, src=0, group=reader.checkpoint_group)
            prefix = holder[0]
    dataset = open_corpus(prefix, d.cache_dir)
    samples = GPTSamples(dataset, d.seq_len, d.val_fraction)
    batches = _batches(samples, ResumableSampler(samples.num_train, d.seed), t, reader)
    return TrainingData(batches, dataset.checksum, metadata_of([dataset], vocab_size), prefix)


def metadata_of(corpora: Sequence[Corpus], vocab_size: Optional[int]) -> dict:
    """The first MegaTier corpus's record with the largest vocabulary of them all; for Megatron corpora, which
    record no vocabulary, ``vocab_size`` (validation requires model.vocab_size for them)."""
    own = [c.metadata for c in corpora if not isinstance(c, MegatronIndexedDataset)]
    sizes = [m["vocab_size"] for m in own]
    if len(own) < len(corpora):
        sizes.append(vocab_size)
    if None in sizes:
        raise ValueError(f"{corpora[0].prefix} is a Megatron corpus, which records no vocabulary; set "
                         f"model.vocab_size to its tokenizer's")
    return dict(own[0] if own else corpora[0].metadata, vocab_size=max(sizes))


class SplitSamples:
    """The train split then the valid split in one index space, as GPTSamples lays out its own, so that
    BatchSource reads training samples [0, num_train) and validation samples after them."""

    def __init__(self, train: Samples, valid: Optional[Samples]):
        self.train, self.valid = train, valid
        self.num_train, self.num_val = len(train), len(valid) if valid is not None else 0

    def sample(self, index: int) -> np.ndarray:
        if index < self.num_train:
            return self.train.sample(index)
        return self.valid.sample(index - self.num_train)

    def stack(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and labels, each (len(indices), seq_len)."""
        rows = torch.from_numpy(np.stack([self.sample(i) for i in indices]))
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class InOrder:
    """Training sample k after k consumed: Megatron's blend is already in its shuffled order."""

    def __init__(self, num_train: int):
        self.num_train = num_train

    def indices(self, start: int, count: int) -> list[int]:
        if start + count > self.num_train:
            raise IndexError(f"training asks for samples up to {start + count}, but the blend was built with "
                             f"{self.num_train} (data.train_samples, or train.iters x train.global_batch_size)")
        return list(range(start, start + count))


def _megatron_data(d, t, reader: Reader, vocab_size: Optional[int]) -> TrainingData:
    plans = split_plans(d.blend, d.split, {"train": d.train_blend, "valid": d.valid_blend, "test": d.test_blend})
    counts = megatron_sample_counts(t, d.train_samples)
    builder = SplitBuilder(lambda prefix: open_corpus(prefix, d.cache_dir), d.seq_len, d.seed,
                           d.mid_level_dataset_surplus)
    if plans["train"] is None:
        raise ValueError(f"data.split={d.split!r} gives the train split no documents; give it a positive weight")
    train = builder.build(plans["train"], counts["train"])
    valid = None
    if plans["valid"] is not None and counts["valid"] > 0:
        valid = builder.build(plans["valid"], counts["valid"])
    if reader.rank == 0:
        log.info("data: %d training and %d validation samples from %s", len(train), len(valid or ()),
                 ", ".join(builder.corpora))
    checksum = blend_checksum(plans, builder.corpora, d.mid_level_dataset_surplus)
    batches = _batches(SplitSamples(train, valid), InOrder(len(train)), t, reader)
    return TrainingData(batches, checksum, metadata_of(list(builder.corpora.values()), vocab_size), None)


def blend_checksum(plans: dict, corpora: dict[str, Corpus], surplus: float) -> str:
    """One checksum over every corpus file a blend reads and what shapes its order besides the seed and
    sequence length (which the fingerprint holds): the weights, the split and the surplus. Paths are left
    out, so moving the files keeps the job."""
    record = {"surplus": surplus}
    for name, plan in plans.items():
        if plan is not None and all(p in corpora for p in plan.prefixes):
            record[name] = {"weights": plan.weights, "bookend": plan.bookend, "per_split": plan.per_split,
                            "corpora": [corpora[p].checksum for p in plan.prefixes]}
    return xxhash.xxh64(json.dumps(record, sort_keys=True).encode()).hexdigest()
