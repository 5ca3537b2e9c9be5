"""What ``megatier-preprocess`` does, apart from its flags: pick the documents and the tokenizer a request names,
and write the corpus (:mod:`megatier.data.tokenize_writer`).

A request that cannot be carried out (an input that is missing or in no format read here, a JSON key a record
lacks, a tokenizer that does not load) raises ``ValueError`` or ``FileNotFoundError`` with one line saying what
is wrong and what to do; the command prints it and exits with status 2.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Iterable, Optional

from megatier.data.document_sources import HFDatasetSource, check_inputs, iter_documents, iter_hf_dataset
from megatier.data.tokenize_writer import FORMATS, WriteSummary, write_corpus
from megatier.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, train_bpe

TOKENIZERS = ("byte", "bpe", "hf")


@dataclass
class PreprocessRequest:
    output_prefix: str
    inputs: list[str] = field(default_factory=list)
    hf_dataset: Optional[HFDatasetSource] = None
    json_key: str = "text"
    tokenizer: str = "byte"
    tokenizer_path: Optional[str] = None  # bpe: a tokenizer.json; hf: a model directory or its tokenizer.json
    bpe_vocab_size: int = 4096
    eod_token: Optional[str] = None
    output_format: str = "megatron"
    workers: int = 1
    append_eod: bool = True
    chunk_documents: int = 64


def check_request(request: PreprocessRequest) -> None:
    """Refuse a request before any work: inputs, format, tokenizer choice and worker count."""
    if request.inputs and request.hf_dataset:
        raise ValueError("give either --input files or --hf-dataset, not both (preprocess them into separate "
                         "corpora and blend them with data.blend)")
    if request.output_format not in FORMATS:
        raise ValueError(f"unknown --output-format {request.output_format!r}; use one of {', '.join(FORMATS)}")
    if request.tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown --tokenizer {request.tokenizer!r}; use one of {', '.join(TOKENIZERS)}")
    if request.tokenizer == "hf" and not request.tokenizer_path:
        raise ValueError("--tokenizer hf needs --tokenizer-path: a model directory (tokenizer.json, or GPT-2's "
                         "vocab.json and merges.txt) or a tokenizer.json file")
    if request.workers < 1:
        raise ValueError(f"--workers {request.workers}: give at least 1 worker process")
    if request.chunk_documents < 1:
        raise ValueError(f"--chunk-documents {request.chunk_documents}: give at least 1")
    check_inputs(request.inputs)


def documents(request: PreprocessRequest) -> Iterable[str]:
    """The request's documents, read afresh on each call (training a BPE reads them once more)."""
    if request.hf_dataset:
        return iter_hf_dataset(request.hf_dataset, request.json_key)
    return iter_documents(request.inputs, request.json_key)


def build_tokenizer(request: PreprocessRequest) -> Tokenizer:
    """The tokenizer the request names; a BPE without a file is trained on the documents and saved beside the
    output as ``<prefix>.tokenizer.json``."""
    if request.tokenizer == "byte":
        return ByteTokenizer()
    if request.tokenizer == "hf":
        from megatier.data.hf_tokenizer import HFTokenizer

        return HFTokenizer(request.tokenizer_path, request.eod_token)
    if request.tokenizer_path:
        return BPETokenizer(request.tokenizer_path)
    return train_bpe(iter(documents(request)), request.bpe_vocab_size, request.output_prefix + ".tokenizer.json")


def run_preprocess(request: PreprocessRequest, progress: bool = False) -> tuple[Tokenizer, WriteSummary]:
    """Check the request, build its tokenizer and write its corpus."""
    check_request(request)
    tokenizer = build_tokenizer(request)
    metadata = {"tokenizer": tokenizer.spec(), "eod_id": tokenizer.eod_id, "sources": source_count(request)}
    os.makedirs(os.path.dirname(os.path.abspath(request.output_prefix)), exist_ok=True)
    summary = write_corpus(documents(request), request.output_prefix, tokenizer,
                           output_format=request.output_format, workers=request.workers,
                           append_eod=request.append_eod, chunk_documents=request.chunk_documents,
                           progress=progress, metadata=metadata)
    return tokenizer, summary


def source_count(request: PreprocessRequest) -> int:
    return 1 if request.hf_dataset else len(request.inputs)
