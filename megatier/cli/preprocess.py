r"""Turn text or JSONL files into a MegaTier token dataset (<prefix>.bin + <prefix>.idx).

    # your data, byte-level tokens
    megatier-preprocess --input corpus/*.txt --output-prefix data/mycorpus
    # JSONL, BPE trained on the inputs (saved as <prefix>.tokenizer.json)
    megatier-preprocess --input docs.jsonl --json-key text --tokenizer bpe --vocab-size 8192 \
        --output-prefix data/docs
    # JSONL with an existing tokenizer.json
    megatier-preprocess --input docs.jsonl --tokenizer bpe --tokenizer-file tokenizer.json \
        --output-prefix data/docs
    # no --input: the default corpus (Python's standard library source)
    megatier-preprocess --output-prefix data/stdlib

Then train on it with `megatier-train data.prefix=data/mycorpus`.
"""
from __future__ import annotations

import argparse
import sys
import time

from megatier.data.corpus import build_dataset, stdlib_files
from megatier.data.indexed import IndexedDataset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="*", default=[], help="text files (one document each) or .jsonl files")
    p.add_argument("--output-prefix", required=True, help="writes <prefix>.bin and <prefix>.idx")
    p.add_argument("--tokenizer", choices=["byte", "bpe"], default="byte")
    p.add_argument("--tokenizer-file", help="existing tokenizer.json for --tokenizer bpe (else one is trained)")
    p.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size when training one")
    p.add_argument("--json-key", default="text", help="field holding the text in JSONL records")
    p.add_argument("--default-corpus-mib", type=float, default=8.0,
                   help="size of the default corpus when no --input is given")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    paths = args.input or stdlib_files(int(args.default_corpus_mib * 2**20))
    if not args.input:
        print(f"no --input: using {len(paths)} files of Python's standard library as the corpus")
    start = time.perf_counter()
    try:
        build_dataset(paths, args.output_prefix, tokenizer=args.tokenizer, bpe_vocab_size=args.vocab_size,
                      tokenizer_file=args.tokenizer_file, json_key=args.json_key)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ds = IndexedDataset(args.output_prefix)
    print(f"wrote {args.output_prefix}.bin/.idx: {ds.num_documents} documents, {ds.num_tokens:,} tokens, "
          f"vocab {ds.metadata['vocab_size']} ({ds.metadata['tokenizer']['type']}) "
          f"in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
