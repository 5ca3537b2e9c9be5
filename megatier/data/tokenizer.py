"""Tokenizers: byte-level (no files) and BPE through the `tokenizers` library.

A tokenizer is described by a small JSON-able spec stored in the dataset's
index, so training always uses the tokenizer the data was made with.
"""
from __future__ import annotations

import os
from typing import Iterable, Iterator, Protocol


class Tokenizer(Protocol):
    vocab_size: int
    eod_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def spec(self) -> dict: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus one end-of-document token (256)."""

    vocab_size = 257
    eod_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def spec(self) -> dict:
        return {"type": "byte"}


EOD_TOKEN = "<|endoftext|>"


class BPETokenizer:
    """Byte-level BPE from a tokenizer.json (HuggingFace `tokenizers` format)."""

    def __init__(self, path: str):
        from tokenizers import Tokenizer as HFTokenizer

        path = os.path.abspath(os.path.expanduser(path))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer file {path} does not exist; train one with "
                                    f"megatier-preprocess --tokenizer bpe or pass an existing tokenizer.json")
        self.path = path
        self._tok = HFTokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size()
        eod = self._tok.token_to_id(EOD_TOKEN)
        if eod is None:
            raise ValueError(f"tokenizer {path} has no {EOD_TOKEN} token; MegaTier separates documents with it")
        self.eod_id = eod

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids))

    def spec(self) -> dict:
        return {"type": "bpe", "path": self.path}


def train_bpe(texts: Iterator[str], vocab_size: int, path: str) -> BPETokenizer:
    """Train a byte-level BPE tokenizer on ``texts`` and save it to ``path`` (tokenizer.json)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    tok.save(tmp)
    os.replace(tmp, path)
    return BPETokenizer(path)


def load_tokenizer(spec: dict) -> Tokenizer:
    kind = spec.get("type")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "bpe":
        return BPETokenizer(spec["path"])
    if kind == "hf":
        from megatier.data.hf_tokenizer import HFTokenizer

        return HFTokenizer(spec["path"], spec.get("eod_token"))
    raise ValueError(f"unknown tokenizer type {kind!r} in dataset index; expected byte, bpe or hf")
