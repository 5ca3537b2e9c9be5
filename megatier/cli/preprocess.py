r"""Turn text, JSON lines, parquet or a Hugging Face dataset into a token corpus (<prefix>.bin + <prefix>.idx),
in Megatron's indexed format (the default) or MegaTier's (--output-format megatier).

    # your data, byte-level tokens
    megatier-preprocess --input corpus/*.txt --output-prefix data/mycorpus
    # JSONL, BPE trained on the inputs (saved as <prefix>.tokenizer.json)
    megatier-preprocess --input docs.jsonl --json-key text --tokenizer bpe --vocab-size 8192 \
        --output-prefix data/docs
    # JSONL with an existing tokenizer.json
    megatier-preprocess --input docs.jsonl --tokenizer bpe --tokenizer-file tokenizer.json \
        --output-prefix data/docs
    # compressed JSONL and parquet with a model's tokenizer, on 8 worker processes
    megatier-preprocess --input web.jsonl.zst shard-*.parquet --tokenizer hf \
        --tokenizer-path models/Llama-3.1-8B --workers 8 --output-prefix data/web
    # a Hugging Face dataset (from its cache, or a local folder), streamed
    megatier-preprocess --hf-dataset wikitext --hf-config wikitext-103-raw-v1 --hf-split train \
        --tokenizer hf --tokenizer-path models/gpt2 --output-prefix data/wikitext
    # no --input: the default corpus (Python's standard library source)
    megatier-preprocess --output-prefix data/stdlib

Then train on it with `megatier-train data.prefix=data/mycorpus` (a Megatron corpus also needs
model.vocab_size), or blend it with data.blend.
"""
from __future__ import annotations

import argparse
import sys

from megatier.data.corpus import stdlib_files
from megatier.data.document_sources import HFDatasetSource
from megatier.data.megatron_indexed import open_corpus
from megatier.data.preprocessing import TOKENIZERS, PreprocessRequest, run_preprocess
from megatier.data.tokenize_writer import FORMATS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="*", default=[],
                   help="text files (one document each), .jsonl/.json (also .gz, .zst) or .parquet files")
    p.add_argument("--hf-dataset", help="a Hugging Face dataset: a name (its cache, else the Hub) or a local "
                                        "folder (data files, or written by save_to_disk)")
    p.add_argument("--hf-split", default="train", help="the split of --hf-dataset")
    p.add_argument("--hf-config", help="the configuration (subset) of --hf-dataset")
    p.add_argument("--hf-streaming", action=argparse.BooleanOptionalAction, default=True,
                   help="stream --hf-dataset (default); --no-hf-streaming reads a dataset prepared in the cache "
                        "(downloading and preparing it first if it is not there)")
    p.add_argument("--output-prefix", required=True, help="writes <prefix>.bin and <prefix>.idx")
    p.add_argument("--output-format", choices=FORMATS, default="megatron",
                   help="megatron: Megatron-LM's indexed format (MMIDIDX); megatier: MegaTier's MTIDX001, which "
                        "records the tokenizer and the .bin's checksum")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default="byte",
                   help="byte: UTF-8 bytes; bpe: a trained or given tokenizer.json; hf: a Hugging Face model's")
    p.add_argument("--tokenizer-file", "--tokenizer-path", dest="tokenizer_path",
                   help="bpe: an existing tokenizer.json (else one is trained); hf: a model directory or its "
                        "tokenizer.json")
    p.add_argument("--eod-token", help="hf: the end-of-document token, when the tokenizer's configs name none")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size when training one")
    p.add_argument("--json-key", "--json-keys", dest="json_key", default="text",
                   help="field holding the text in JSON lines, column in parquet and Hugging Face datasets")
    p.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                   help="end each document that has tokens with the end-of-document token, as Megatron's "
                        "--append-eod (MegaTier's format always does)")
    p.add_argument("--workers", type=int, default=1, help="tokenizing processes; the output is the same for any")
    p.add_argument("--chunk-documents", type=int, default=64, help="documents sent to a worker at a time")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar with documents and tokens per second (default: on a terminal)")
    p.add_argument("--default-corpus-mib", type=float, default=8.0,
                   help="size of the default corpus when no --input is given")
    return p.parse_args(argv)


def request_of(args: argparse.Namespace) -> PreprocessRequest:
    hf = HFDatasetSource(args.hf_dataset, args.hf_split, args.hf_config,
                                                     args.hf_streaming) if args.hf_dataset else None
    inputs = args.input
    if not inputs and not hf:
        inputs = stdlib_files(int(args.default_corpus_mib * 2**20))
        print(f"no --input: using {len(inputs)} files of Python's standard library as the corpus")
    return PreprocessRequest(args.output_prefix, inputs, hf, args.json_key, args.tokenizer, args.tokenizer_path,
                             args.vocab_size, args.eod_token, args.output_format, args.workers, args.append_eod,
                             args.chunk_documents)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    try:
        tokenizer, summary = run_preprocess(request_of(args), progress=progress)
        corpus = open_corpus(args.output_prefix)  # computes (and remembers) the data checksum once
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output_prefix}.bin/.idx ({args.output_format}): {summary.documents:,} documents, "
          f"{summary.tokens:,} tokens, vocab {tokenizer.vocab_size} ({tokenizer.spec()['type']}), checksum "
          f"{corpus.checksum}, in {summary.seconds:.2f}s ({summary.documents_per_second:,.0f} documents/s, "
          f"{summary.tokens_per_second:,.0f} tokens/s, {args.workers} worker(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
