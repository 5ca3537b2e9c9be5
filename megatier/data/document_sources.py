"""Where preprocessing reads documents from: text files, JSON lines (plain, .gz, .zst), parquet files, and Hugging
Face datasets (a name in the `datasets` cache or on the Hub, a local folder of data files, or a folder written by
``Dataset.save_to_disk``), streamed.

Every source yields the documents' texts in the order they are stored, so the same inputs always give the same
token file. A reader that needs an optional library imports it when used and, when it is missing, says which
extra to install.
"""
from __future__ import annotations

import gzip
import io
import json
import os
from dataclasses import dataclass
from typing import IO, Iterator, Optional

JSONL_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".jsonl.zst", ".json.zst")
PARQUET_SUFFIXES = (".parquet",)
# Formats a user may reasonably hand over that no reader here takes: refused rather than read as text.
UNREAD_SUFFIXES = (".gz", ".zst", ".bz2", ".xz", ".zip", ".tar", ".7z", ".lz4", ".csv", ".tsv", ".arrow",
                   ".feather", ".bin", ".idx")
PARQUET_BATCH_ROWS = 1024


class SourceError(ValueError):
    """Input that cannot be read as documents; the message names the input and what to do."""


def missing_extra(module: str, purpose: str) -> SourceError:
    return SourceError(f"{purpose} needs the Python package {module!r}; install it with "
                       f"`pip install 'megatier[data]'` (or `pip install {module}`)")


@dataclass(frozen=True)
class HFDatasetSource:
    """A Hugging Face dataset: ``name`` is a dataset name (cache or Hub) or a local folder."""

    name: str
    split: str = "train"
    config: Optional[str] = None
    streaming: bool = True


def input_kind(path: str) -> str:
    """``"jsonl"``, ``"parquet"`` or ``"text"`` by the file's name; SourceError for a format no reader takes."""
    lower = path.lower()
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if lower.endswith(UNREAD_SUFFIXES):
        raise SourceError(f"{path}: unknown input format (extension {os.path.splitext(lower)[1]!r}); give text "
                          f"files, .jsonl (also .jsonl.gz, .jsonl.zst), .parquet, or a Hugging Face dataset with "
                          f"--hf-dataset")
    return "text"


def check_inputs(paths: list[str]) -> None:
    """SourceError naming the first missing or unreadable input, before any work is done."""
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise SourceError(f"input file(s) not found: {', '.join(missing[:3])}; check the --input paths")
    for path in paths:
        input_kind(path)


def iter_documents(paths: list[str], json_key: str = "text") -> Iterator[str]:
    """The documents of ``paths`` in order: a text file is one document, a JSON line or a parquet row one each."""
    for path in paths:
        kind = input_kind(path)
        if kind == "jsonl":
            yield from iter_jsonl(path, json_key)
        elif kind == "parquet":
            yield from iter_parquet(path, json_key)
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                yield f.read()


def open_text(path: str) -> IO[str]:
    """``path`` as UTF-8 text, decompressed by its extension (.gz with gzip, .zst with zstandard)."""
    lower = path.lower()
    if lower.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    if lower.endswith(".zst"):
        try:
            import zstandard
        except ImportError as e:
            raise missing_extra("zstandard", f"reading {path}") from e
        raw = open(path, "rb")
        return io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True), encoding="utf-8")
    return open(path, encoding="utf-8")


def iter_jsonl(path: str, json_key: str) -> Iterator[str]:
    """Field ``json_key`` of each non-blank line of a JSON-lines file."""
    with open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                yield record_text(parse_json_line(path, lineno, line), json_key, f"{path}:{lineno}")


def parse_json_line(path: str, lineno: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise SourceError(f"{path}:{lineno}: not valid JSON ({e.msg}); expected one object per line") from e
    if not isinstance(record, dict):
        raise SourceError(f"{path}:{lineno}: a JSON {type(record).__name__}, not an object; expected one object "
                          f"per line")
    return record


def record_text(record: dict, json_key: str, where: str) -> str:
    """The text under ``json_key`` (a null is an empty document)."""
    if json_key not in record:
        raise SourceError(f"{where}: no field {json_key!r} (fields: {', '.join(sorted(record)[:8])}); choose the "
                          f"field with --json-key")
    value = record[json_key]
    if isinstance(value, (list, dict)):
        raise SourceError(f"{where}: field {json_key!r} holds a {type(value).__name__}, not a string; give one text "
                          f"per document (sentence-split documents are not taken)")
    return "" if value is None else str(value)


def iter_parquet(path: str, json_key: str) -> Iterator[str]:
    """Column ``json_key`` of a parquet file, row by row, read a batch of rows at a time."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise missing_extra("pyarrow", f"reading {path}") from e
    parquet = pq.ParquetFile(path)
    columns = parquet.schema_arrow.names
    if json_key not in columns:
        raise SourceError(f"{path}: no column {json_key!r} (columns: {', '.join(columns[:8])}); choose the column "
                          f"with --json-key")
    row = 0
    for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[json_key]):
        for value in batch.column(0).to_pylist():
            yield record_text({json_key: value}, json_key, f"{path}: row {row}")
            row += 1


def iter_hf_dataset(source: HFDatasetSource, json_key: str) -> Iterator[str]:
    """Column ``json_key`` of a Hugging Face dataset's split, a batch of rows at a time, that column only."""
    dataset = load_hf_dataset(source)
    columns = dataset.column_names
    if columns is not None:
        if json_key not in columns:
            raise SourceError(f"dataset {source.name} ({source.split}): no column {json_key!r} (columns: "
                              f"{', '.join(columns[:8])}); choose the column with --json-key")
        dataset = dataset.select_columns([json_key])
    row = 0
    for batch in dataset.iter(batch_size=PARQUET_BATCH_ROWS):
        if json_key not in batch:
            raise SourceError(f"dataset {source.name} ({source.split}) row {row}: no column {json_key!r}; choose "
                              f"the column with --json-key")
        for value in batch[json_key]:
            yield record_text({json_key: value}, json_key, f"dataset {source.name} ({source.split}) row {row}")
            row += 1


def load_hf_dataset(source: HFDatasetSource):
    """The split: ``load_from_disk`` for a saved folder, else ``load_dataset`` (a local folder of data files, or
    a name, found in the cache first), streamed unless ``source.streaming`` is off (then read memory-mapped from
    the cache, where an offline machine keeps a prepared dataset)."""
    try:
        import datasets
    except ImportError as e:
        raise missing_extra("datasets", f"reading the Hugging Face dataset {source.name}") from e
    try:
        if is_saved_dataset(source.name):
            saved = datasets.load_from_disk(source.name)
            return saved[source.split] if isinstance(saved, datasets.DatasetDict) else saved
        return datasets.load_dataset(source.name, source.config, split=source.split, streaming=source.streaming)
    except (OSError, ValueError, KeyError, datasets.exceptions.DatasetNotFoundError) as e:  # OSError: offline
        raise SourceError(f"cannot open the Hugging Face dataset {source.name} (split {source.split}): "
                          f"{str(e).splitlines()[0] if str(e) else type(e).__name__}; check --hf-dataset, "
                          f"--hf-split and --hf-config") from e


def is_saved_dataset(name: str) -> bool:
    """Whether ``name`` is a folder written by ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return os.path.isdir(name) and any(os.path.isfile(os.path.join(name, marker))
                                       for marker in ("state.json", "dataset_dict.json"))
