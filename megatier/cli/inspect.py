"""What every checkpoint tier holds for a job, with every payload's checksum verified; or, with --plan, what
they will hold.

    megatier-inspect --job-id run42
    megatier-inspect --job-id run42 --local-root /dev/shm/megatier \\
        --remote-url s3://bucket/runs --endpoint-url http://127.0.0.1:9000
    megatier-inspect --plan --nodes 2 --procs-per-node 4 -- model=gpt2_124m parallel.tp=2 parallel.pp=2
    megatier-inspect data --samples 0:8 -- <overrides>    # what the model will see (megatier.cli.inspect_data)

Tier-1/Tier-2: one row per payload in every node directory under
``<local-root>/<job-id>/`` (own payloads and the replicas a node holds for its
ring predecessor). Tier-3: one row per unit under ``<remote-url>/<job-id>/``,
committed or not, with every rank's object verified against its record.

``--plan`` composes the config of ``pretrain_gpt.py <overrides>`` (``checkpoint=tiered`` unless an override
picks a checkpoint preset) on ``--nodes`` x ``--procs-per-node`` processes and prints, before any launch, the
bytes of each rank's base, diff step and step unit and what Tier-1, Tier-2 and Tier-3 hold per rank and per
node at steady state (:mod:`megatier.checkpoint.offline.plan`).

Exit status: 0 all found payloads verify (a plan was printed); 1 nothing was found for the job;
2 a payload failed verification or a tier could not be read (the config cannot be planned).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
from typing import Optional

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from megatier.checkpoint.offline.listing import Row, inspect_local, inspect_remote
from megatier.checkpoint.offline.plan import (
    COMMIT_LAG_BATCHES,
    Cluster,
    PlanError,
    RankSizes,
    Retention,
    SizePlan,
    plan,
)
from megatier.checkpoint.offline.state import step_ranges
from megatier.checkpoint.storage.store import RetryPolicy, StoreError
from megatier.checkpoint.tiers.remote import open_remote_store
from megatier.cli import inspect_data
from megatier.config import CheckpointConfig, Config, ConfigError, compose_config, split_overrides
from megatier.model.params import count_active_parameters, count_parameters

_DEFAULTS = CheckpointConfig()


def human(n: int) -> str:
    """Bytes in B, KiB, MiB or GiB."""
    value, unit = float(n), "B"
    for larger in ("KiB", "MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"


def render(rows: list[Row]) -> str:
    """Aligned columns; the status column last and unpadded (it may be long)."""
    header = ("tier", "where", "rank", "unit", "size", "xxh64", "status")
    cells = [header] + [(r.tier, r.where, r.rank, r.unit, human(r.size), r.xxh64, r.status) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header) - 1)]
    return "\n".join("  ".join(c[i].ljust(widths[i]) for i in range(len(widths))) + "  " + c[-1] for c in cells)


def parse_args(argv: list[str]) -> argparse.Namespace:
    argv, overrides = split_overrides(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="--plan: Hydra overrides after --")
    p.add_argument("--job-id", help="checkpoint.job_id of the run")
    p.add_argument("--local-root", default=_DEFAULTS.local.root, help="checkpoint.local.root (Tier-1/Tier-2)")
    p.add_argument("--remote-url", default=_DEFAULTS.remote.url, help="checkpoint.remote.url (Tier-3)")
    p.add_argument("--endpoint-url", default=None, help="checkpoint.remote.endpoint_url for S3-compatible services")
    p.add_argument("--no-local", action="store_true", help="skip Tier-1/Tier-2")
    p.add_argument("--no-remote", action="store_true", help="skip Tier-3")
    p.add_argument("--plan", action="store_true", help="print the size plan of the config the overrides after -- "
                                                       "compose, instead of inspecting a job")
    p.add_argument("--nodes", type=int, default=1, help="--plan: nodes of the job")
    p.add_argument("--procs-per-node", type=int, default=1, help="--plan: training processes per node")
    args = p.parse_args(argv)
    args.overrides = overrides
    if not args.plan and (args.job_id is None or overrides):
        p.error("give --job-id to inspect a job's checkpoints (Hydra overrides after -- go with --plan)")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["data"]:  # what the model will see (megatier.cli.inspect_data)
        return inspect_data.main(argv[1:])
    args = parse_args(argv)
    if args.plan:
        return plan_main(args)
    rows: list[Row] = []
    unreadable = []
    if not args.no_local:
        rows += inspect_local(args.local_root, args.job_id)
    if not args.no_remote:
        try:
            store = open_remote_store(args.remote_url, args.job_id, endpoint_url=args.endpoint_url,
                                      retry=RetryPolicy(attempts=3, base_delay_s=0.2, max_delay_s=1.0))
            rows += inspect_remote(store, args.job_id)
        except (ConfigError, StoreError) as err:
            unreadable.append(f"Tier-3 at {args.remote_url}: {err}")
    if rows:
        print(f"checkpoints of job {args.job_id!r}")
        print(render(rows))
    for message in unreadable:
        print(f"error: {message}", file=sys.stderr)
    failed = [r for r in rows if not r.ok]
    if failed:
        print(f"error: {len(failed)} payload(s) failed verification (see FAILED rows); recovery will skip them",
              file=sys.stderr)
        return 2
    if unreadable:
        return 2
    if not rows:
        print(f"error: no checkpoints of job {args.job_id!r} in Tier-1 ({os.path.join(args.local_root, args.job_id)})"
              f" or Tier-3 ({args.remote_url.rstrip('/')}/{args.job_id}); check --job-id, --local-root and "
              f"--remote-url", file=sys.stderr)
        return 1
    return 0


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]


def _kept(r: Retention) -> str:
    units = f" + {r.step_units} step units" if r.step_units else ""
    return f"{r.bases} bases + {r.diff_steps} steps of diffs{units}"


def _payload_rows(sp: SizePlan) -> list[str]:
    """One row per pipeline stage and sizes as printed (ranks that differ by a few header bytes share one)."""
    batch = sp.ckpt.diff.batch
    groups: dict[tuple, list[RankSizes]] = {}
    for r in sp.ranks:
        sizes = (human(r.base), human(r.diff_batch // batch), human(r.diff_batch), human(r.step_unit) if r.step_unit
                 else "-")
        groups.setdefault((str(r.layout.pp_rank), f"{r.shard_numel:,}", *sizes), []).append(r)
    rows = [(step_ranges([r.layout.rank for r in group], sep=","), key[0],
             step_ranges([r.layout.tp_rank for r in group], sep=","), *key[1:])
            for key, group in groups.items()]
    return _table(("ranks", "pp", "tp", "shard elements", "base", "diff step", "diff batch", "step unit"), rows)


def _tier_lines(sp: SizePlan) -> list[str]:
    """What each tier in use keeps of a rank, in units."""
    c, ret = sp.ckpt, sp.retention
    lag = COMMIT_LAG_BATCHES * c.diff.batch
    lines = []
    if "local" in c.tiers:
        if "remote" in c.tiers:
            lines.append(f"  Tier-1 node memory: {_kept(ret['node'])} while Tier-3 keeps up (the watermark reaches "
                         f"a base about {lag} steps after it)")
        lines.append(f"  Tier-1 node memory: {_kept(ret['node_bound'])} while Tier-3 is behind or down (the "
                     f"{c.local.keep_bases} newest bases and their chains, and a new base until its reclaim)")
    if "peer" in c.tiers:
        lines.append("  Tier-2: the same again, as the replica in the next node's memory")
    if "remote" in c.tiers:
        which = f"every {c.remote.base_every}th base goes there: " if c.remote.base_every > 1 else ""
        lines.append(f"  Tier-3: {_kept(ret['tier3'])} ({which}{c.remote.keep_bases} committed bases and one "
                     f"uploading, the diffs since the committed base before the watermark)")
    return lines


def _node_rows(sp: SizePlan) -> list[str]:
    """Node memory per node (nodes of equal totals on one row) while Tier-3 keeps up and while it is behind."""
    groups: dict[tuple[int, int], list[int]] = {}
    for n in range(sp.cluster.nodes):
        groups.setdefault((sp.node_bytes(n, "node"), sp.node_bytes(n, "node_bound")), []).append(n)
    ppn = sp.cluster.procs_per_node
    rows = [(f"node{step_ranges(nodes, sep=',')}" if len(nodes) == 1 else f"nodes {step_ranges(nodes, sep=',')}",
             step_ranges([r for n in nodes for r in range(n * ppn, (n + 1) * ppn)], sep=","), human(typical),
             human(bound))
            for (typical, bound), nodes in groups.items()]
    return _table(("nodes", "their ranks", "each, Tier-3 keeping up", "each, Tier-3 behind or down"), rows)


def _room(sp: SizePlan) -> str:
    """How much this machine's checkpoint.local.root has free, against the largest node's need."""
    where = os.path.abspath(os.path.expanduser(sp.ckpt.local.root))
    while not os.path.exists(where):
        where = os.path.dirname(where)
    free = shutil.disk_usage(where).free
    need = max(sp.node_bytes(n, "node_bound") for n in range(sp.cluster.nodes))
    verdict = "enough" if free >= need else "NOT enough"
    return (f"here, {where} (checkpoint.local.root {sp.ckpt.local.root}) has {human(free)} free: {verdict} for the "
            f"largest node's {human(need)} while Tier-3 is behind")


def _vocab_note(sp: SizePlan) -> list[str]:
    """Say that the parameter count follows the data's vocabulary when no model.vocab_size sets it (a gpt2_124m
    preset on byte data has 86M parameters, not GPT-2's 124M)."""
    if sp.vocab[1] == "model.vocab_size":
        return []
    return [f"note: the vocabulary (and so the parameter count) is the data's, {sp.vocab[0]} tokens; set "
            f"model.vocab_size to plan another, e.g. model.vocab_size=50257 for GPT-2's"]


def render_plan(sp: SizePlan, cfg: Config) -> str:
    """The plan as a report: the setting, payloads per rank, what each tier keeps, node memory, Tier-3 in all."""
    c, d, p = sp.ckpt, sp.ckpt.diff, cfg.parallel
    params = count_parameters(cfg.model, sp.vocab[0])
    millions = f"{params / 1e6:.{1 if params >= 1e6 else 2}f}"  # two figures for a model under a million
    active = count_active_parameters(cfg.model, sp.vocab[0])
    if active != params:  # a mixture of experts: what one token passes through
        millions += f"M parameters, {active / 1e6:.{1 if active >= 1e6 else 2}f}M active"
    else:
        millions += "M parameters"
    lines = [f"size plan: model {cfg.model.name} ({millions}, vocabulary {sp.vocab[0]} from "
             f"{sp.vocab[1]}), tp={p.tp} pp={p.pp} dp={p.dp(sp.cluster.world_size)} on {sp.cluster.nodes} nodes x "
             f"{sp.cluster.procs_per_node} processes",
             f"checkpoint: job {c.job_id!r}, diff {d.compression} (top-k {d.topk_ratio}, int8 below "
             f"{d.small_threshold} elements), batch {d.batch}{', per step' if d.per_step else ''}; a base every "
             f"{c.base_interval} steps; tiers {', '.join(c.tiers)}",
             *(f"note: {n}" for n in sp.notes), *_vocab_note(sp), "", "payloads per rank, as serialized:",
             *_payload_rows(sp)]
    if d.compression in ("adaptive", "topk"):
        lines.append("(top-k records are planned at the count they aim for; real ones keep more or fewer: on the "
                     "demo within 2%)")
    lines += ["", "held per rank at steady state (reclaim/policy.py):", *_tier_lines(sp)]
    if "local" in c.tiers:
        where = " and the Tier-2 replicas of the node before it" if "peer" in c.tiers else ""
        lines += ["", f"node memory per node (its ranks' Tier-1{where}):", *_node_rows(sp), _room(sp)]
    if "remote" in c.tiers:
        lines += ["", f"Tier-3 ({c.remote.url}): {human(sp.tier3_bytes())} for the whole job"]
    return "\n".join(lines)


def plan_main(args: argparse.Namespace) -> int:
    """Compose the overrides' config, plan it on the cluster, print the plan; 2 with one line if it cannot."""
    preset = [] if any(o.lstrip("+~").startswith("checkpoint=") for o in args.overrides) else ["checkpoint=tiered"]
    try:
        cfg = compose_config(preset + args.overrides)
        sp = plan(cfg, Cluster(args.nodes, args.procs_per_node))
    except (PlanError, ConfigError, HydraException, OmegaConfBaseException) as err:
        first = str(err).strip().splitlines()[0]  # Hydra goes on with the search path; the first line says it
        print(f"megatier-inspect --plan: error: {first}", file=sys.stderr)
        return 2
    print(render_plan(sp, cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
