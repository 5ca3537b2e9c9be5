"""Export a job's checkpoint as a Hugging Face directory (GPT-2 or Llama), from any tier and any layout.

    megatier-convert export --job-id run42 out/gpt2
    megatier-convert export --job-id run42 --step 800 --tier tier3 --data-prefix data/corpus out/gpt2-800 \\
        --local-root /dev/shm/megatier --remote-url s3://bucket/runs --endpoint-url http://127.0.0.1:9000

For a ``model.arch=llama`` job the directory is a ``transformers.LlamaForCausalLM`` one (its names and
config.json: :mod:`megatier.interop.llama`), with ``model.moe`` a ``MixtralForCausalLM`` one
(:mod:`megatier.interop.mixtral`). For GPT-2, it writes ``config.json`` and ``model.safetensors``
(fp32, GPT-2 names, Conv1D
orientation, the true vocabulary) that ``transformers.GPT2LMHeadModel
.from_pretrained`` loads, plus the tokenizer files of the run's data when
it used BPE: ``--data-prefix``, else the default corpus the units' checksum
names, else the ``data.prefix`` of the run directory's config.yaml
(``--run-dir``, by default ``runs/<job id>``, where a job named by
``logging.name`` writes it); a tokenizer found nowhere is a warning. The
state is the one a restore of the job installs at the
point (by default the newest, as a restore chooses it; ``--step N`` another
one every rank of some layout reaches), rebuilt in this process from whatever
layout wrote it (:mod:`megatier.checkpoint.offline.state`), with every unit checksum-verified and
a bad copy replaced by another tier's (:mod:`megatier.checkpoint.offline.tiers`). The model and
optimizer settings come from the config fingerprint the units carry, so no
config file is needed. The last line is the state's canonical digest, the
``canonical_digest`` of the training run's summary at that step.

``--format torchtitan`` writes the whole job instead, as torchtitan's CheckpointManager saves it
(``out_dir/step-N``; :mod:`megatier.interop.torchtitan_dcp`), for a ``model.arch=llama`` job;
``--format torch_dist`` as Megatron-LM saves a GPT-2-, Llama- or Mixtral-shaped one (``out_dir/iter_NNNNNNN``
and its tracker file; :mod:`megatier.interop.megatron_dist`); ``--format megatron_legacy`` as its torch format does
(``out_dir/iter_NNNNNNN/mp_rank_TT[_PPP]/{model_optim_rng.pt,distrib_optim.pt}`` at ``--tp`` x ``--pp`` ranks,
``--bucket-size`` as Megatron's ``--ddp-bucket-size``;
:mod:`megatier.interop.megatron_legacy`).

Importing needs no command: ``model.init_from=<dir>`` starts training from
such a directory, ``model.init_from=torchtitan:<folder>``, ``torch_dist:<save dir>`` or
``megatron_legacy:<save dir>`` continues such a job.

Exit status: 0 exported; 1 nothing to export (no checkpoints, no such step,
an output directory in use, bad arguments); 2 a unit has no good copy or a
tier could not be read. Nothing is written unless the export succeeds.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Optional

import yaml

from megatier.checkpoint.offline.state import (
    Rebuilt,
    choose_point,
    point_fingerprint,
    rebuild,
    run_configs,
    step_ranges,
)
from megatier.checkpoint.offline.tiers import NOTHING, ExportError, OfflineTiers
from megatier.checkpoint.recover.consensus import Consensus
from megatier.checkpoint.tiers.base import TIER_ORDER
from megatier.cli.inspect import human
from megatier.config import CheckpointConfig, ModelConfig
from megatier.data.corpus import find_cached_corpus
from megatier.data.indexed import IndexedDataset
from megatier.interop.hf_files import HFFormatError
from megatier.interop.huggingface import export_hf
from megatier.interop.job_state import JobFormatError, JobState
from megatier.interop.megatron_dist import export_megatron_dist
from megatier.interop.megatron_legacy import export_megatron_legacy
from megatier.interop.torchtitan_dcp import export_torchtitan
from megatier.optim.canonical import canonical_digest
from megatier.optim.schedule import schedule_of
from megatier.parallel.layout import layout_str

_DEFAULTS = CheckpointConfig()


def check_output(out_dir: str) -> None:
    """Refuse an output path that is a file or a non-empty directory, before anything is read."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ExportError(f"{out_dir} exists and is not a directory; give a new or empty directory")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise ExportError(f"{out_dir} exists and is not empty; give a new or empty directory (nothing was "
                          f"written)")


def data_tokenizer(prefix: Optional[str], fingerprint: dict, run_dir: Optional[str] = None) -> Optional[dict]:
    """The tokenizer spec of the run's data at ``prefix`` (None without one), checked to be the data the units
    were trained on (the fingerprint records its checksum). Without ``prefix``: the default corpus of that
    checksum in the cache, else the data.prefix ``run_dir``'s config.yaml names when its tokens are those."""
    if prefix is None:
        recorded = json.loads(fingerprint.get("data.checksum", "null"))
        prefix = find_cached_corpus(recorded) if recorded is not None else None
        prefix = prefix or _run_data_prefix(run_dir, recorded)
        if prefix is None:
            return None
    try:
        dataset = IndexedDataset(prefix)
    except (OSError, ValueError) as e:
        raise ExportError(f"--data-prefix {prefix}: {e}") from None
    recorded = json.loads(fingerprint.get("data.checksum", "null"))
    if recorded is not None and dataset.checksum != recorded:
        raise ExportError(f"--data-prefix {prefix} holds other tokens (xxh64 {dataset.checksum}) than the job "
                          f"trained on ({recorded}); give the run's data.prefix, or leave --data-prefix out")
    return dataset.metadata.get("tokenizer")


def _run_data_prefix(run_dir: Optional[str], recorded: Optional[str]) -> Optional[str]:
    """The data.prefix ``run_dir``/config.yaml names, when it holds the ``recorded`` tokens (else None)."""
    path = os.path.join(run_dir, "config.yaml") if run_dir and recorded else None
    try:
        with open(path) as f:
            prefix = (yaml.safe_load(f).get("data") or {}).get("prefix")
        return prefix if prefix and IndexedDataset(prefix).checksum == recorded else None
    except (TypeError, OSError, ValueError, AttributeError, yaml.YAMLError):  # no run directory of this job here
        return None


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _point_line(job_id: str, c: Consensus, fp_id: str) -> str:
    replayed = len(c.chains[0]) - 1
    how = f"{_count(replayed, 'diff unit')} replayed per rank" if replayed else "no replay"
    return (f"point: job {job_id!r} step {c.end} from base v{c.version} ({how}), written by {layout_str(c.degrees)} "
            f"({_count(math.prod(c.degrees), 'rank')}), config fingerprint {fp_id}")


def _replay_line(c: Consensus, rebuilt: Rebuilt) -> str:
    if c.end == c.version:
        return f"replay: none (the base is at step {c.end})"
    codecs = ", ".join(sorted(rebuilt.codecs)) or "no"
    steps = step_ranges(range(c.version + 1, c.end + 1))
    if rebuilt.codecs <= {"fp32"}:
        return f"replay: steps {steps} from {codecs} diffs: exact, the state training had at step {c.end}"
    return (f"replay: steps {steps} from {codecs} diffs: lossy, the state a restore to step {c.end} installs "
            f"(not bitwise the one training had)")


def _read_line(rebuilt: Rebuilt) -> str:
    total = sum(rebuilt.bytes_by_tier.values())
    tiers = ", ".join(f"{t} {human(rebuilt.bytes_by_tier[t])}" for t in TIER_ORDER if t in rebuilt.bytes_by_tier)
    return f"read: {_count(rebuilt.units, 'unit')}, {human(total)} ({tiers}), every one checksum-verified"


def _model_line(m: ModelConfig, weights: dict) -> str:
    vocab = weights["word.weight"].shape[0]
    nbytes = sum(t.numel() * 4 for t in weights.values())
    return (f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_heads} heads, vocabulary {vocab} "
            f"({len(weights)} tensors, {human(nbytes)} fp32)")


def _tokenizer_line(spec: Optional[dict], run_dir: str) -> str:
    if spec is None:
        return (f"tokenizer: none: the run's data is not the default corpus and {run_dir}/config.yaml names none "
                f"with its tokens; give --data-prefix <the run's data.prefix> (or --run-dir) to add its tokenizer")
    if spec.get("type") == "bpe":
        return "tokenizer: bpe of the run's data (tokenizer.json, tokenizer_config.json)"
    return f"tokenizer: {spec.get('type')} of the run's data (no files: ids are UTF-8 bytes; eos id in config.json)"


def _digest_line(c: Consensus, rebuilt: Rebuilt) -> str:
    exact = rebuilt.codecs <= {"fp32"}
    which = ("the training run's summary canonical_digest at that step" if exact
             else "the restored state's; lossy diffs make it differ from the training run's summary")
    return (f"canonical_digest: {canonical_digest(rebuilt.canonical)} (master, exp_avg and exp_avg_sq at step "
            f"{c.end}: {which})")


def export(args: argparse.Namespace) -> list[str]:
    """Run ``export`` (module docstring); returns the report's lines. Raises ExportError with one line."""
    check_output(args.out_dir)
    tiers = OfflineTiers(args.job_id, args.local_root, args.remote_url, endpoint_url=args.endpoint_url,
                         tiers=args.tier or TIER_ORDER)
    holdings = tiers.holdings()
    point = choose_point(holdings, args.job_id, args.step)
    fp_id, fingerprint = point_fingerprint(holdings, point)
    model_cfg, optim_cfg = run_configs(fingerprint, fp_id)
    run_dir = args.run_dir or os.path.join("runs", args.job_id)
    tokenizer = data_tokenizer(args.data_prefix, fingerprint, run_dir)
    rebuilt = rebuild(tiers, point, optim_cfg)
    weights = {name: kinds["master"] for name, kinds in rebuilt.canonical.items()}
    check_output(args.out_dir)  # nothing appeared meanwhile
    try:
        if args.format == "hf":
            export_hf(weights, model_cfg, args.out_dir, tokenizer=tokenizer)
        else:
            _export_job(args, rebuilt, point.end, model_cfg, optim_cfg, fingerprint)
    except (HFFormatError, JobFormatError) as e:
        raise ExportError(str(e)) from None
    return [_point_line(args.job_id, point, fp_id), _read_line(rebuilt),
            *(f"fallback: {line}" for line in rebuilt.fallbacks), _replay_line(point, rebuilt),
            _model_line(model_cfg, weights), _tokenizer_line(tokenizer, run_dir),
            f"wrote: {args.out_dir} ({', '.join(sorted(os.listdir(args.out_dir)))})", _digest_line(point, rebuilt)]


def _export_job(args: argparse.Namespace, rebuilt: Rebuilt, step: int, m: ModelConfig, o, fingerprint: dict) -> None:
    """The whole job at ``step`` (weights, Adam's moments and count, the step, the tokens consumed) in
    ``args.format``; the param groups' lr is the schedule's at the next step (unset decay horizon: optim.lr)."""
    seq_len, batch = (json.loads(fingerprint.get(k, "null")) for k in ("data.seq_len", "train.global_batch_size"))
    tokens = step * batch * seq_len if seq_len and batch else None
    lr = schedule_of(o, o.decay_iters, batch)(step + 1) if o.decay_iters and batch else o.lr
    job = JobState(rebuilt.canonical, step, rebuilt.adam_steps, consumed_tokens=tokens)
    if args.format == "torchtitan":
        export_torchtitan(job, m, o, args.out_dir, lr)
    elif args.format == "megatron_legacy":
        job.consumed_samples = step * batch if batch else None
        export_megatron_legacy(job, m, o, args.out_dir, lr, tp=args.tp, pp=args.pp, bucket_size=args.bucket_size)
    else:
        export_megatron_dist(job, m, o, args.out_dir, lr, batch)


def _step(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; steps count from 0")
    return value


class _Parser(argparse.ArgumentParser):
    """Bad arguments get one line and exit status 1, like every other refusal of this command."""

    def error(self, message: str):
        self.exit(NOTHING, f"error: {message}; see {self.prog} --help\n")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = _Parser(prog="megatier-convert", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export", help="write a Hugging Face directory (GPT-2 or Llama) from a job's checkpoint")
    e.add_argument("out_dir", help="the directory to write (new or empty)")
    e.add_argument("--job-id", required=True, help="checkpoint.job_id of the run")
    e.add_argument("--step", type=_step, default=None,
                   help="the step to export (default: the newest recovery point, as a restore chooses it)")
    e.add_argument("--tier", action="append", choices=TIER_ORDER, default=None,
                   help="read only this tier (repeatable; default: all): tier1 own areas, tier2 replica areas, "
                        "tier3 committed remote units")
    e.add_argument("--format", choices=("hf", "torchtitan", "torch_dist", "megatron_legacy"), default="hf",
                   help="hf: a Hugging Face directory (weights); torchtitan: the whole job as torchtitan's DCP "
                        "checkpoint folder (out_dir/step-N: weights, AdamW state, step, LR scheduler, tokens seen); "
                        "torch_dist: the whole job (GPT-2, Llama, MoE) as Megatron-LM's --save directory "
                        "(out_dir/iter_N); "
                        "megatron_legacy: the same in Megatron-LM's torch format (mp_rank_TT, distrib_optim.pt)")
    e.add_argument("--tp", type=int, default=1,
                   help="megatron_legacy: tensor-parallel ranks to write (mp_rank_00, ...; it must divide the heads)")
    e.add_argument("--pp", type=int, default=1,
                   help="megatron_legacy: pipeline stages to write (mp_rank_TT_PPP; it must divide the layers)")
    e.add_argument("--bucket-size", type=int, default=None,
                   help="megatron_legacy: Megatron's --ddp-bucket-size in elements: distrib_optim.pt in buckets as "
                        "--overlap-grad-reduce saves it (default: one bucket)")
    e.add_argument("--data-prefix", default=None,
                   help="the run's data.prefix: adds its tokenizer (BPE files, eos id); checked against the job's")
    e.add_argument("--run-dir", default=None,
                   help="the run's logging.run_dir (default runs/<job id>): without --data-prefix, its config.yaml's "
                        "data.prefix gives the tokenizer")
    e.add_argument("--local-root", default=_DEFAULTS.local.root, help="checkpoint.local.root (Tier-1/Tier-2)")
    e.add_argument("--remote-url", default=_DEFAULTS.remote.url, help="checkpoint.remote.url (Tier-3)")
    e.add_argument("--endpoint-url", default=None, help="checkpoint.remote.endpoint_url for S3-compatible services")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        lines = export(args)
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.status
    print("\n".join(lines))
    for line in (x for x in lines if x.startswith("tokenizer: none:")):  # the directory lacks what generation needs
        print(f"warning: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

