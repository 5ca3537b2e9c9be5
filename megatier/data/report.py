"""What a job's model will see, before any training: its corpora, each split's blend as asked and as drawn, how
many epochs of each corpus a split reads, and any sample by its index (megatier-inspect data).

The samples are those training reads: the same builders (megatier.data.megatron_splits for blends, GPTSamples and
ResumableSampler for ``data.prefix``) and the same counts (megatier.data.source.megatron_sample_counts), so
training sample k here is the sample that global training step s reads at position k - consumed_before(s).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from megatier.data.blend import BlendedSamples
from megatier.data.corpus import ensure_default_corpus, tokenizer_of
from megatier.data.dataset import GPTSamples, ResumableSampler
from megatier.data.megatron_indexed import Corpus, MegatronIndexedDataset, open_corpus
from megatier.data.megatron_splits import SPLITS, SplitBuilder, SplitPlan, split_documents, split_plans
from megatier.data.source import megatron_sample_counts, uses_megatron_splits


@dataclass
class CorpusReport:
    prefix: str
    format: str  # megatier | megatron
    dtype: str
    documents: int
    tokens: int


@dataclass
class PartReport:
    """One corpus's part of a split."""

    prefix: str
    documents: int  # of the corpus, in this split
    tokens: int
    requested: float  # share of the split's samples the blend asks of it
    realized: float  # share the blend's samples take from it
    samples: int  # samples the split draws from it
    epochs: float  # times the split reads its documents' tokens: samples x seq_len / tokens


@dataclass
class SplitReport:
    name: str
    requested: int  # samples the job asks of the split (Megatron's counts; for data.prefix, training's)
    samples: int  # samples the split holds
    parts: list[PartReport] = field(default_factory=list)


@dataclass
class Sample:
    split: str
    index: int
    prefix: str  # the corpus it comes from
    tokens: np.ndarray  # seq_len + 1 tokens: inputs are the first seq_len, labels the last

    def as_dict(self, text: Optional[str]) -> dict:
        out = {"split": self.split, "index": self.index, "corpus": self.prefix, "tokens": self.tokens.tolist()}
        if text is not None:
            out["text"] = text
        return out


class DataReport:
    """The report of data config ``d`` under training config ``t`` (see the module docstring)."""

    def __init__(self, d, t):
        self.seq_len, self.seed = d.seq_len, d.seed
        self.corpora: dict[str, Corpus] = {}
        self.splits: dict[str, SplitReport] = {}
        self._samples: dict[str, object] = {}
        if uses_megatron_splits(d):
            self.how = "data.blend" if d.blend is not None else "data.train_blend/valid_blend/test_blend"
            self._blends(d, t)
        else:
            self.how = "data.prefix" if d.prefix is not None else "data.prefix (the default corpus)"
            self._prefix(d, t)

    # ---- building ---------------------------------------------------------------------------

    def _blends(self, d, t) -> None:
        plans = split_plans(d.blend, d.split, {"train": d.train_blend, "valid": d.valid_blend, "test": d.test_blend})
        counts = megatron_sample_counts(t, d.train_samples)
        builder = SplitBuilder(lambda prefix: open_corpus(prefix, d.cache_dir), d.seq_len, d.seed,
                               d.mid_level_dataset_surplus)
        for name in SPLITS:
            plan = plans[name]
            if plan is None or counts[name] <= 0:
                continue
            samples = builder.build(plan, counts[name])
            self._samples[name] = samples
            self.splits[name] = SplitReport(name, counts[name], len(samples), self._parts(plan, samples, builder))
        self.corpora = dict(builder.corpora)

    def _parts(self, plan: SplitPlan, samples, builder: SplitBuilder) -> list[PartReport]:
        if isinstance(samples, BlendedSamples):
            requested = list(samples.weights)
            drawn = np.bincount(samples.corpus_of, minlength=len(samples.parts)).tolist()
        else:
            requested, drawn = [1.0], [len(samples)]
        total = max(1, sum(drawn))
        parts = []
        for prefix, share, count in zip(plan.prefixes, requested, drawn):
            corpus = builder.corpus(prefix)
            documents = split_documents(len(corpus.sequence_lengths), plan.bookend)
            tokens = int(np.sum(corpus.sequence_lengths[documents], dtype=np.int64))
            parts.append(PartReport(prefix, len(documents), tokens, share, count / total, count,
                                    count * self.seq_len / tokens if tokens else 0.0))
        return parts

    def _prefix(self, d, t) -> None:
        prefix = d.prefix or ensure_default_corpus(d.cache_dir, d.tokenizer, d.default_corpus_mib, d.bpe_vocab_size)
        corpus = open_corpus(prefix, d.cache_dir)
        self.corpora = {prefix: corpus}
        samples = GPTSamples(corpus, d.seq_len, d.val_fraction)
        self._own = (samples, ResumableSampler(samples.num_train, d.seed))
        asked = t.iters * t.global_batch_size
        tokens = samples.num_train * d.seq_len
        self.splits["train"] = SplitReport("train", asked, samples.num_train, [
            PartReport(prefix, corpus.num_documents, tokens, 1.0, 1.0, asked, asked / samples.num_train)])
        if samples.num_val:
            asked = t.eval_iters * t.global_batch_size  # every evaluation reads the same first samples
            self.splits["valid"] = SplitReport("valid", asked, samples.num_val, [
                PartReport(prefix, corpus.num_documents, samples.num_val * d.seq_len, 1.0, 1.0, asked,
                           asked / samples.num_val)])

    # ---- reading ----------------------------------------------------------------------------

    def corpus_rows(self) -> list[CorpusReport]:
        return [CorpusReport(prefix, "megatron" if isinstance(c, MegatronIndexedDataset) else "megatier",
                             np.dtype(c.dtype).name, len(c.sequence_lengths), int(c.num_tokens))
                for prefix, c in self.corpora.items()]

    def sample(self, split: str, index: int) -> Sample:
        """Sample ``index`` of ``split`` in the order training (or evaluation) reads it."""
        if split not in self.splits:
            raise ValueError(f"the job has no {split} split; it has {', '.join(self.splits)}")
        size = self.splits[split].samples
        if split == "train" and split not in self._samples:  # data.prefix: epochs go on past the corpus's end
            size = max(size, self.splits[split].requested)
        if not 0 <= index < size:
            raise ValueError(f"the {split} split holds samples 0..{size - 1}, not {index}")
        if split in self._samples:  # a blend (or one Megatron split): its own order
            samples = self._samples[split]
            if isinstance(samples, BlendedSamples):
                prefix = self.splits[split].parts[int(samples.corpus_of[index])].prefix
            else:
                prefix = self.splits[split].parts[0].prefix
            return Sample(split, index, prefix, samples.sample(index))
        own, sampler = self._own
        prefix = self.splits[split].parts[0].prefix
        at = sampler.index(index) if split == "train" else own.num_train + index
        return Sample(split, index, prefix, own.sample(at))

    def decode(self, sample: Sample) -> Optional[str]:
        """The sample's text by its corpus's tokenizer; None for a corpus that records none (Megatron's)."""
        corpus = self.corpora[sample.prefix]
        if isinstance(corpus, MegatronIndexedDataset) or "tokenizer" not in corpus.metadata:
            return None
        return tokenizer_of(corpus.metadata).decode(sample.tokens.tolist())

    def as_dict(self) -> dict:
        return {"how": self.how, "seq_len": self.seq_len, "seed": self.seed,
                "corpora": [vars(c) for c in self.corpus_rows()],
                "splits": [{"name": s.name, "requested": s.requested, "samples": s.samples,
                            "parts": [vars(p) for p in s.parts]} for s in self.splits.values()]}
