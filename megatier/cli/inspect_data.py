"""megatier-inspect data: what the model will see, before any training.

    megatier-inspect data -- 'data.blend=[0.3,/data/web,0.7,/data/code]' data.split=969/30/1 model.vocab_size=50257
    megatier-inspect data --samples 0:8 -- experiment=demo
    megatier-inspect data --json --samples 0:4 --split valid -- <overrides>

Per corpus its documents and tokens; per split the samples asked and held, each corpus's requested and realized
share of them and the epochs of its documents they read; then the samples ``--samples`` names (default 0:4) in
the order training reads them, decoded where the corpus records its tokenizer. ``--json`` prints the same as one
JSON object, with every sample's token ids (its seq_len + 1 tokens). The report itself is
:mod:`megatier.data.report`.

Exit status: 0 printed; 2 the overrides or the data cannot give a report (one line naming the problem).
"""
from __future__ import annotations

import argparse
import json
import sys

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from megatier.config import ConfigError, compose_config, split_overrides, validate
from megatier.data.report import DataReport

PROG = "megatier-inspect data"


def _range(text: str) -> range:
    """``a:b`` (samples a..b-1) or ``a`` (that one sample)."""
    try:
        if ":" in text:
            first, end = (int(v) for v in text.split(":", 1))
        else:
            first = int(text)
            end = first + 1
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a range of sample indices; give e.g. 0:8") from None
    if first < 0 or end <= first:
        raise argparse.ArgumentTypeError(f"{text!r} is empty or negative; give e.g. 0:8")
    return range(first, end)


def parse_args(argv: list[str]) -> argparse.Namespace:
    argv, overrides = split_overrides(argv)
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                epilog="the training config's Hydra overrides after --")
    p.add_argument("--samples", type=_range, default=range(0, 4), help="sample indices a:b to show (default 0:4)")
    p.add_argument("--split", default="train", choices=("train", "valid", "test"), help="whose samples to show")
    p.add_argument("--json", action="store_true", help="one JSON object, samples with their token ids")
    args = p.parse_args(argv)
    args.overrides = overrides
    return args


def _pct(x: float) -> str:
    return f"{100.0 * x:.2f}%"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]


def render(report: DataReport, samples: list, texts: list) -> str:
    lines = [f"data: {report.how}, seq_len {report.seq_len}, seed {report.seed}", ""]
    lines += _table(("corpus", "format", "dtype", "documents", "tokens"),
                    [(c.prefix, c.format, c.dtype, f"{c.documents:,}", f"{c.tokens:,}") for c in report.corpus_rows()])
    rows = []
    for s in report.splits.values():
        for i, p in enumerate(s.parts):
            head = (s.name, f"{s.requested:,}", f"{s.samples:,}") if i == 0 else ("", "", "")
            rows.append((*head, p.prefix, f"{p.documents:,}", f"{p.tokens:,}", _pct(p.requested), _pct(p.realized),
                         f"{p.samples:,}", f"{p.epochs:.3f}"))
    lines += ["", *_table(("split", "asked", "holds", "corpus", "documents", "tokens", "requested", "realized",
                           "samples", "epochs"), rows)]
    if samples:
        lines += ["", f"{samples[0].split} samples {samples[0].index}:{samples[-1].index + 1} (seq_len + 1 tokens "
                      f"each; inputs the first seq_len, labels the last):"]
    for sample, text in zip(samples, texts):
        shown = repr(text) if text is not None else " ".join(str(t) for t in sample.tokens[:16].tolist()) + (
            " ..." if len(sample.tokens) > 16 else "") + " (token ids: the corpus records no tokenizer)"
        lines.append(f"  {sample.index} from {sample.prefix}: {shown}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        cfg = compose_config(args.overrides)
        validate(cfg)
        report = DataReport(cfg.data, cfg.train)
        samples = [report.sample(args.split, i) for i in args.samples]
        texts = [report.decode(s) for s in samples]
    except (ConfigError, HydraException, OmegaConfBaseException, FileNotFoundError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"{PROG}: error: {first}", file=sys.stderr)
        return 2
    if args.json:
        out = report.as_dict()
        out["samples"] = [s.as_dict(t) for s, t in zip(samples, texts)]
        print(json.dumps(out))
    else:
        print(render(report, samples, texts))
    return 0
