"""A Hugging Face model's tokenizer, by its directory or its tokenizer.json, through the `tokenizers` library.

It tokenizes as Megatron-LM's ``HuggingFaceTokenizer`` does by default: the text's ids without the special tokens
the model's template would add (no BOS), and the end-of-document id is the tokenizer's end-of-sequence token.

A directory is read as ``transformers`` lays it out: ``tokenizer.json`` (Llama and most models since), else
GPT-2's ``vocab.json`` and ``merges.txt``; the end-of-sequence token comes from ``tokenizer_config.json`` (or
``special_tokens_map.json``), else from the usual names.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Optional

# End-of-sequence tokens of common model families, tried in order when no config names one.
KNOWN_EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>", "[SEP]")
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")


class HFTokenizer:
    """The tokenizer at ``path`` (a model directory or a tokenizer.json); ``eod_token`` overrides the EOS."""

    def __init__(self, path: str, eod_token: Optional[str] = None):
        self.path = os.path.abspath(os.path.expanduser(path))
        self._tok = load_tokenizers_object(self.path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod_token = eod_token or eos_token_of(self.path, self._tok)
        eod = self._tok.token_to_id(self.eod_token)
        if eod is None:
            raise ValueError(f"tokenizer {self.path} has no token {self.eod_token!r}; name its end-of-document "
                             f"token with --eod-token")
        self.eod_id = eod

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode(list(ids))

    def spec(self) -> dict:
        return {"type": "hf", "path": self.path, "eod_token": self.eod_token}


def load_tokenizers_object(path: str):
    """A ``tokenizers.Tokenizer`` from a tokenizer.json file, or from a directory's tokenizer.json or GPT-2 files."""
    from tokenizers import Tokenizer

    if os.path.isfile(path):
        return _from_file(Tokenizer, path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer {path} does not exist; pass a model directory or its tokenizer.json")
    tokenizer_json = os.path.join(path, "tokenizer.json")
    if os.path.isfile(tokenizer_json):
        return _from_file(Tokenizer, tokenizer_json)
    vocab, merges = os.path.join(path, "vocab.json"), os.path.join(path, "merges.txt")
    if os.path.isfile(vocab) and os.path.isfile(merges):
        return gpt2_tokenizer(vocab, merges)
    raise ValueError(f"{path} holds neither tokenizer.json nor vocab.json and merges.txt; a sentencepiece-only "
                     f"model (tokenizer.model) can be converted with transformers: "
                     f"AutoTokenizer.from_pretrained(dir).save_pretrained(dir)")


def _from_file(tokenizer_class, path: str):
    try:
        return tokenizer_class.from_file(path)
    except Exception as e:  # the Rust library raises its own Exception for any malformed file
        raise ValueError(f"{path} is not a tokenizer.json the tokenizers library reads ({e})") from e


def gpt2_tokenizer(vocab: str, merges: str):
    """GPT-2's byte-level BPE from its vocab.json and merges.txt, as transformers' GPT2TokenizerFast builds it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    prefix_space = bool(read_tokenizer_config(os.path.dirname(vocab)).get("add_prefix_space", False))
    tok = Tokenizer(models.BPE.from_file(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix_space)
    tok.decoder = decoders.ByteLevel()
    added = _added_tokens(os.path.dirname(vocab))
    if added:
        tok.add_special_tokens(added)
    return tok


def _added_tokens(directory: str) -> list[str]:
    """Special tokens a GPT-2 directory lists in its configs that the vocabulary may not hold."""
    config = read_tokenizer_config(directory)
    names = [_token_text(config.get(key)) for key in ("bos_token", "eos_token", "unk_token", "pad_token")]
    return sorted({n for n in names if n})


def read_tokenizer_config(directory: str) -> dict:
    """tokenizer_config.json and special_tokens_map.json merged (the first wins), {} without them."""
    merged: dict = {}
    for name in reversed(CONFIG_FILES):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                merged.update(json.load(f))
    return merged


def _token_text(value) -> Optional[str]:
    """A token as configs write it: a string, or an AddedToken dict with its ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def eos_token_of(path: str, tok) -> str:
    """The end-of-sequence token: the configs' ``eos_token``, else the first known EOS token the vocabulary has."""
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    configured = _token_text(read_tokenizer_config(directory).get("eos_token"))
    if configured:
        return configured
    for token in KNOWN_EOS_TOKENS:
        if tok.token_to_id(token) is not None:
            return token
    raise ValueError(f"tokenizer {path} names no end-of-sequence token (no eos_token in tokenizer_config.json and "
                     f"none of {', '.join(KNOWN_EOS_TOKENS)}); name it with --eod-token")
