"""megatier-preprocess's other inputs: Hugging Face datasets, Hugging Face tokenizers (a GPT-2 directory, a Llama-style
tokenizer.json) tokenizing as transformers does without special tokens, and bad input refused with one line."""
from __future__ import annotations

import json

import numpy as np
import pytest

from megatier.cli.preprocess import main as preprocess
from megatier.data.hf_tokenizer import HFTokenizer
from megatier.data.megatron_indexed import MegatronIndexedDataset
from megatier.data.tokenizer import ByteTokenizer, load_tokenizer
from tests.unit.data.test_preprocess_megatron import TEXTS, megatron_reference, same_files, write_jsonl

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _offline(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGATIER_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")  # read when loading


def trained_bpe(directory, special: list[str]):
    """A small byte-level BPE trained here (no download), with ``special`` as its first tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 3, trainer=trainer)
    directory.mkdir(exist_ok=True)
    return tok


def write_gpt2_dir(directory, add_prefix_space: bool = False):
    """A GPT-2 directory as older checkpoints ship it: vocab.json and merges.txt, no tokenizer.json."""
    trained_bpe(directory, ["<|endoftext|>"]).model.save(str(directory))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
         "unk_token": "<|endoftext|>", "model_max_length": 1024, "add_prefix_space": add_prefix_space}))
    return directory


@pytest.fixture
def gpt2_dir(tmp_path):
    return write_gpt2_dir(tmp_path / "gpt2")


@pytest.fixture
def gpt2_prefix_space_dir(tmp_path):
    return write_gpt2_dir(tmp_path / "gpt2_prefix_space", add_prefix_space=True)


@pytest.fixture
def llama_dir(tmp_path):
    """A Llama-style directory: tokenizer.json whose template adds <s>, and a config naming </s> the EOS."""
    from tokenizers import processors

    directory = tmp_path / "llama"
    tok = trained_bpe(directory, ["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "add_bos_token": True}))
    return directory


@pytest.mark.parametrize("which", ["gpt2_dir", "gpt2_prefix_space_dir", "llama_dir"])
def test_hf_tokenizer_tokenizes_as_transformers_without_special_tokens(which, request):
    """Megatron's HuggingFaceTokenizer: the text's ids without the template's BOS, the EOS as end of document."""
    from transformers import AutoTokenizer

    directory = request.getfixturevalue(which)
    reference = AutoTokenizer.from_pretrained(str(directory))
    ours = HFTokenizer(str(directory))
    for text in TEXTS[:12]:
        assert ours.encode(text) == reference(text, add_special_tokens=False).input_ids
    assert ours.eod_id == reference.eos_token_id
    assert ours.vocab_size == len(reference)
    assert load_tokenizer(ours.spec()).encode(TEXTS[3]) == ours.encode(TEXTS[3])


def test_hf_tokenizer_by_its_file_gives_the_directorys_corpus(tmp_path, llama_dir):
    source = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    by_dir, by_file, reference = str(tmp_path / "dir"), str(tmp_path / "file"), str(tmp_path / "reference")
    assert preprocess(["--input", source, "--output-prefix", by_dir, "--tokenizer", "hf",
                       "--tokenizer-path", str(llama_dir), "--workers", "2"]) == 0
    assert preprocess(["--input", source, "--output-prefix", by_file, "--tokenizer", "hf",
                       "--tokenizer-path", str(llama_dir / "tokenizer.json")]) == 0
    megatron_reference(reference, TEXTS, HFTokenizer(str(llama_dir)), np.uint16)
    assert same_files(by_dir, reference) and same_files(by_file, reference)


def test_a_saved_hugging_face_dataset_gives_the_jsonl_corpus(tmp_path):
    import datasets

    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"body": TEXTS}).save_to_disk(str(saved))
    jsonl = write_jsonl(tmp_path / "d.jsonl", TEXTS, key="body")
    from_hf, from_jsonl = str(tmp_path / "hf"), str(tmp_path / "jsonl")
    assert preprocess(["--hf-dataset", str(saved), "--json-key", "body", "--output-prefix", from_hf]) == 0
    assert preprocess(["--input", jsonl, "--json-key", "body", "--output-prefix", from_jsonl]) == 0
    assert same_files(from_hf, from_jsonl)


@pytest.mark.parametrize("streaming", ["--hf-streaming", "--no-hf-streaming"])
def test_a_folder_of_data_files_is_read_through_load_dataset(tmp_path, streaming):
    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", TEXTS)
    out, reference = str(tmp_path / "out"), str(tmp_path / "reference")
    assert preprocess(["--hf-dataset", str(folder), "--hf-split", "train", streaming, "--output-prefix", out]) == 0
    megatron_reference(reference, TEXTS, ByteTokenizer(), np.uint16)
    assert same_files(out, reference)
    assert MegatronIndexedDataset(out).num_documents == len(TEXTS)


@pytest.mark.parametrize("case, expected", [
    ("missing", "not found: "),
    ("extension", "unknown input format (extension '.csv')"),
    ("jsonl_key", "d.jsonl:1: no field 'body'"),
    ("parquet_key", "no column 'body'"),
    ("hf_key", "no column 'body'"),
    ("hf_missing", "cannot open the Hugging Face dataset"),
    ("hf_without_path", "--tokenizer hf needs --tokenizer-path"),
    ("workers", "give at least 1 worker"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, case, expected):
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = write_jsonl(tmp_path / "d.jsonl", TEXTS[:3])
    (tmp_path / "t.csv").write_text("text\nhello\n")
    pq.write_table(pa.table({"text": TEXTS[:3]}), str(tmp_path / "d.parquet"))
    args = {"missing": ["--input", str(tmp_path / "nope.jsonl")],
            "extension": ["--input", str(tmp_path / "t.csv")],
            "jsonl_key": ["--input", jsonl, "--json-key", "body"],
            "parquet_key": ["--input", str(tmp_path / "d.parquet"), "--json-key", "body"],
            "hf_key": ["--hf-dataset", str(tmp_path / "saved"), "--json-key", "body"],
            "hf_missing": ["--hf-dataset", str(tmp_path / "no-such-dataset")],
            "hf_without_path": ["--input", jsonl, "--tokenizer", "hf"],
            "workers": ["--input", jsonl, "--workers", "0"]}[case]
    if case == "hf_key":
        import datasets

        datasets.Dataset.from_dict({"text": TEXTS[:3]}).save_to_disk(str(tmp_path / "saved"))
    capsys.readouterr()
    assert preprocess([*args, "--output-prefix", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err and err.count("\n") == 1, err
    assert not (tmp_path / "out.idx").exists() and not (tmp_path / "out.bin").exists()


def test_a_missing_reader_names_the_extra_to_install(tmp_path, capsys, monkeypatch):
    (tmp_path / "d.jsonl.zst").write_bytes(b"")
    monkeypatch.setitem(__import__("sys").modules, "zstandard", None)  # as if not installed
    assert preprocess(["--input", str(tmp_path / "d.jsonl.zst"), "--output-prefix", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "'zstandard'" in err and "pip install 'megatier[data]'" in err and err.count("\n") == 1


def test_the_progress_bar_shows_documents_and_tokens_per_second(tmp_path, capsys):
    source = write_jsonl(tmp_path / "d.jsonl", TEXTS)
    assert preprocess(["--input", source, "--output-prefix", str(tmp_path / "out"), "--progress"]) == 0
    captured = capsys.readouterr()
    assert "docs" in captured.err and "tokens/s" in captured.err
    assert f"{len(TEXTS):,} documents" in captured.out and "tokens/s, 1 worker(s)" in captured.out
