"""Tokenizing documents with worker processes into a corpus file, in either format.

Documents go to the workers in chunks and their tokens come back in the order the chunks were sent, so the
output is byte-identical for any number of workers. At most a few chunks per worker are in flight at a time,
so memory stays bounded however large the input (``Pool.imap`` would read the whole input ahead).

End of document, per format:

* Megatron (the default): as Megatron-LM's ``tools/preprocess_data.py --append-eod`` does, the end-of-document
  token closes every document that has tokens; a document with none stays empty (a document of no sequences).
* MegaTier (``MTIDX001``): every document, empty or not, ends with it, as the format defines.
"""
from __future__ import annotations

import functools
import json
import multiprocessing
import time
from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import Callable, Iterable, Iterator, Optional

import numpy as np

from megatier.data.indexed import IndexedDatasetWriter
from megatier.data.megatron_writer import MegatronCorpusWriter, megatron_token_dtype
from megatier.data.tokenizer import Tokenizer, load_tokenizer

FORMATS = ("megatron", "megatier")
CHUNKS_IN_FLIGHT_PER_WORKER = 4


@dataclass(frozen=True)
class EncodeSettings:
    """What a worker needs to turn texts into tokens: picklable, so it travels with each chunk."""

    tokenizer_spec: str  # the tokenizer's spec as JSON (hashable, to build it once per process)
    dtype: str
    eod_id: Optional[int]  # None: no end-of-document token
    eod_on_empty: bool


@dataclass
class EncodedChunk:
    tokens: np.ndarray  # the chunk's documents end to end
    lengths: np.ndarray  # tokens per document


@dataclass
class WriteSummary:
    documents: int
    tokens: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    @property
    def documents_per_second(self) -> float:
        return self.documents / max(self.seconds, 1e-9)


@functools.lru_cache(maxsize=4)
def tokenizer_for(spec_json: str) -> Tokenizer:
    """The tokenizer a spec names, built once per process (workers receive only the spec)."""
    return load_tokenizer(json.loads(spec_json))


def encode_chunk(settings: EncodeSettings, texts: list[str]) -> EncodedChunk:
    """The chunk's documents as one array of tokens in the output dtype (compact to send back) and their lengths."""
    tokenizer = tokenizer_for(settings.tokenizer_spec)
    arrays = []
    for text in texts:
        ids = tokenizer.encode(text)
        if settings.eod_id is not None and (ids or settings.eod_on_empty):
            ids.append(settings.eod_id)
        arrays.append(np.asarray(ids, dtype=settings.dtype))
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    tokens = np.concatenate(arrays) if arrays else np.zeros(0, settings.dtype)
    return EncodedChunk(tokens.astype(settings.dtype, copy=False), lengths)


class MegaTierSink:
    """MegaTier's MTIDX001 writer behind the chunk interface (it takes one document at a time)."""

    def __init__(self, prefix: str, tokenizer: Tokenizer, metadata: dict):
        self.writer = IndexedDatasetWriter(prefix, tokenizer.vocab_size, metadata)
        self.dtype = np.dtype(self.writer.dtype)

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        start = 0
        for length in lengths.tolist():
            self.writer.add_document(tokens[start:start + length])
            start += length

    def close(self) -> None:
        self.writer.close()

    def abort(self) -> None:
        self.writer.abort()


def open_sink(output_format: str, prefix: str, tokenizer: Tokenizer, metadata: dict):
    if output_format == "megatron":
        return MegatronCorpusWriter(prefix, megatron_token_dtype(tokenizer.vocab_size))
    if output_format == "megatier":
        return MegaTierSink(prefix, tokenizer, metadata)
    raise ValueError(f"unknown output format {output_format!r}; use one of {', '.join(FORMATS)}")


def chunked(items: Iterable[str], size: int) -> Iterator[list[str]]:
    iterator = iter(items)
    while chunk := list(islice(iterator, size)):
        yield chunk


def ordered_map(func: Callable, items: Iterable, workers: int) -> Iterator:
    """``func`` over ``items`` on ``workers`` processes (in this process for one), results in input order, with a
    bounded number of items in flight."""
    if workers <= 1:
        yield from map(func, items)
        return
    # spawn: a worker starts clean, without the parent's threads (tokenizers' pool, torch's) that fork would copy
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.apply_async(func, (item,)))
            if len(pending) >= workers * CHUNKS_IN_FLIGHT_PER_WORKER:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def write_corpus(documents: Iterable[str], prefix: str, tokenizer: Tokenizer, *, output_format: str = "megatron",
                 workers: int = 1, append_eod: bool = True, chunk_documents: int = 64, progress: bool = False,
                 metadata: Optional[dict] = None) -> WriteSummary:
    """Tokenize ``documents`` into ``prefix``.bin/.idx in ``output_format``; nothing is left under those names
    if reading or tokenizing fails."""
    sink = open_sink(output_format, prefix, tokenizer, metadata or {})
    settings = EncodeSettings(json.dumps(tokenizer.spec(), sort_keys=True), sink.dtype.name,
                              tokenizer.eod_id if append_eod or output_format == "megatier" else None,
                              eod_on_empty=output_format == "megatier")
    bar = progress_bar(progress)
    start, done_docs, done_tokens = time.perf_counter(), 0, 0
    try:
        encode = functools.partial(encode_chunk, settings)
        for chunk in ordered_map(encode, chunked(documents, chunk_documents), workers):
            sink.add_documents(chunk.tokens, chunk.lengths)
            done_docs, done_tokens = done_docs + len(chunk.lengths), done_tokens + len(chunk.tokens)
            report_progress(bar, len(chunk.lengths), done_tokens, time.perf_counter() - start)
    except BaseException:
        sink.abort()
        raise
    finally:
        bar.close()
    sink.close()
    return WriteSummary(done_docs, done_tokens, time.perf_counter() - start)


def progress_bar(enabled: bool):
    from tqdm import tqdm

    return tqdm(unit=" docs", unit_scale=True, disable=not enabled, mininterval=0.5, dynamic_ncols=True)


def report_progress(bar, documents: int, tokens: int, seconds: float) -> None:
    bar.set_postfix_str(f"{tokens:,} tokens, {tokens / max(seconds, 1e-9):,.0f} tokens/s", refresh=False)
    bar.update(documents)
