"""Turning text into token datasets, and the default corpus that needs no download.

The default corpus is the source of Python's own standard library: every
Python installation carries it, it is real text with real structure, and it is
the same bytes for the same Python version.
"""
from __future__ import annotations

import os
import sysconfig
from typing import Iterator, Optional

from megatier.data import document_sources
from megatier.data.indexed import IndexedDatasetWriter, read_index
from megatier.data.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer, train_bpe

_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__", "lib2to3", "turtledemo"}


def stdlib_files(max_bytes: int) -> list[str]:
    """Sorted standard-library .py files (no tests), up to ``max_bytes`` in total."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        files.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    chosen, total = [], 0
    for path in sorted(files):
        size = os.path.getsize(path)
        if total + size > max_bytes:
            break
        chosen.append(path)
        total += size
    if not chosen:
        raise RuntimeError(f"found no standard-library sources under {root}; pass your own data to "
                           f"megatier-preprocess --input")
    return chosen


def iter_documents(paths: list[str], json_key: str = "text") -> Iterator[str]:
    """Documents from text files (one per file), JSON lines (one per line, field ``json_key``) and parquet files
    (one per row): :func:`megatier.data.document_sources.iter_documents`."""
    return document_sources.iter_documents(paths, json_key)


def build_dataset(paths: list[str], output_prefix: str, *, tokenizer: str = "byte", bpe_vocab_size: int = 4096,
                  tokenizer_file: Optional[str] = None, json_key: str = "text", batch_docs: int = 256) -> dict:
    """Tokenize ``paths`` into ``output_prefix``.bin/.idx; returns the dataset metadata.

    tokenizer: "byte", or "bpe" (load ``tokenizer_file`` if given, else train one
    on the inputs and save it as ``<output_prefix>.tokenizer.json``).
    """
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(f"input file(s) not found: {', '.join(missing[:3])}")
    if tokenizer == "byte":
        tok = ByteTokenizer()
    elif tokenizer == "bpe":
        if tokenizer_file:
            tok = BPETokenizer(tokenizer_file)
        else:
            tok = train_bpe(iter_documents(paths, json_key), bpe_vocab_size, output_prefix + ".tokenizer.json")
    else:
        raise ValueError(f"unknown tokenizer {tokenizer!r}; use byte or bpe")
    meta = {"tokenizer": tok.spec(), "eod_id": tok.eod_id, "sources": len(paths)}
    writer = IndexedDatasetWriter(output_prefix, tok.vocab_size, meta)
    batch: list[str] = []

    def flush() -> None:
        for ids in tok.encode_batch(batch):
            writer.add_document(ids + [tok.eod_id])
        batch.clear()

    for doc in iter_documents(paths, json_key):
        batch.append(doc)
        if len(batch) >= batch_docs:
            flush()
    flush()
    writer.close()
    return writer.metadata


def default_cache_dir(cache_dir: Optional[str]) -> str:
    return os.path.expanduser(cache_dir or os.environ.get("MEGATIER_CACHE") or "~/.cache/megatier")


def default_corpus_prefix(cache_dir: Optional[str], tokenizer: str, mib: float, bpe_vocab_size: int) -> str:
    tag = f"stdlib_{tokenizer}{bpe_vocab_size if tokenizer == 'bpe' else ''}_{mib:g}mib"
    return os.path.join(default_cache_dir(cache_dir), tag)


def ensure_default_corpus(cache_dir: Optional[str], tokenizer: str, mib: float, bpe_vocab_size: int) -> str:
    """Build the default corpus once (idempotent); returns its prefix."""
    prefix = default_corpus_prefix(cache_dir, tokenizer, mib, bpe_vocab_size)
    if os.path.isfile(prefix + ".idx") and os.path.isfile(prefix + ".bin") and _has_checksum(prefix):
        return prefix
    files = stdlib_files(int(mib * 2**20))
    build_dataset(files, prefix, tokenizer=tokenizer, bpe_vocab_size=bpe_vocab_size)
    return prefix


def find_cached_corpus(checksum: str, cache_dir: Optional[str] = None) -> Optional[str]:
    """The prefix of a corpus in the default cache whose tokens have xxh64 ``checksum`` (a run that trained on
    the default corpus records only the checksum), or None."""
    root = default_cache_dir(cache_dir)
    names = sorted(n for n in os.listdir(root) if n.endswith(".idx")) if os.path.isdir(root) else []
    for name in names:
        prefix = os.path.join(root, name[:-len(".idx")])
        try:
            if read_index(prefix + ".idx")[1].get("bin_xxh64") == checksum:
                return prefix
        except (OSError, ValueError):
            continue
    return None


def _has_checksum(prefix: str) -> bool:
    """Whether the corpus at ``prefix`` records its checksum (corpora built before it did are rebuilt)."""
    try:
        return "bin_xxh64" in read_index(prefix + ".idx")[1]
    except (OSError, ValueError):
        return False


def tokenizer_of(metadata: dict):
    return load_tokenizer(metadata["tokenizer"])
