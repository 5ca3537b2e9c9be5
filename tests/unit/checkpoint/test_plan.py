"""The size planner: meta drafts size exactly as serialized payloads, planned records match compressed ones, the
retention counts are what reclaim/policy.py keeps (simulated step by step), and ``megatier-inspect --plan``."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatier import ops
from megatier.checkpoint.format.payload import DiffStep, draft_base, draft_diff_batch
from megatier.checkpoint.format.units import BASE, STEP, PayloadId
from megatier.checkpoint.offline.plan import COMMIT_LAG_BATCHES, Cluster, PlanError, plan, retention
from megatier.checkpoint.reclaim.policy import local_reclaim_set, node_memory_floor, remote_reclaim_set, retention_floor
from megatier.cli.inspect import main as inspect_main
from megatier.config import CheckpointConfig, DiffStreamConfig
from megatier.parallel.layout import Layout
from tests.unit.checkpoint.format.test_payload import make_base

pytestmark = pytest.mark.timeout(60)

LAYOUT = Layout(tp=1, pp=1, dp=2, tp_rank=0, pp_rank=0, dp_rank=1)
SEGMENTS = [(0, 300), (300, 150_000), (150_300, 1000), (151_300, 7)]  # int8, top-k, int8, int8 under adaptive


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


# ---- sizes without data --------------------------------------------------------------------------------------

def test_a_draft_of_meta_tensors_has_the_serialized_size():
    base = make_base()
    real = draft_base(base, job_id="j", layout=LAYOUT).to_payload()
    planned = draft_base(dataclasses.replace(base, master=_meta(base.master), exp_avg=_meta(base.exp_avg),
                                             exp_avg_sq=_meta(base.exp_avg_sq)), job_id="j", layout=LAYOUT)
    assert planned.size == len(real.data) == real.stamp.size


@pytest.mark.parametrize("mode", ["int8", "bf16", "fp32", "adaptive", "topk"])
def test_a_planned_record_is_the_compressed_one(mode):
    grad = torch.randn(sum(n for _, n in SEGMENTS), generator=torch.Generator().manual_seed(3))
    real = ops.compress_segments(grad, SEGMENTS, mode, 0.01, 100_000, seed=9)
    planned = ops.planned_record([n for _, n in SEGMENTS], mode, 0.01, 100_000, seed=9)
    assert list(planned.tensors) == list(real.tensors) and all(t.is_meta for t in planned.tensors.values())
    for name, t in real.tensors.items():
        k = planned.tensors[name].numel()
        if name.startswith("topk"):  # the target count; a sampled threshold keeps within [k/2, 2k]
            assert k == (1514 if mode == "topk" else 1500) and k / 2 <= t.numel() <= 2 * k
        else:
            assert (k, planned.tensors[name].dtype) == (t.numel(), t.dtype), name
    if mode not in ("adaptive", "topk"):
        assert planned.header == real.header
        steps = [DiffStep(s, 1e-3, s, False, r.tensors, r.header) for s, r in ((7, real), (8, real))]
        plan_steps = [DiffStep(s, 1e-3, s, False, planned.tensors, planned.header) for s in (7, 8)]
        real_size = len(draft_diff_batch(steps, job_id="j", layout=LAYOUT).to_payload().data)
        assert draft_diff_batch(plan_steps, job_id="j", layout=LAYOUT).size == real_size


# ---- what each tier keeps, against the policy ---------------------------------------------------------------

def _config(interval=50, batch=5, keep=2, remote_keep=2, per_step=True, every=1) -> CheckpointConfig:
    c = CheckpointConfig(enabled=True, base_interval=interval, diff=DiffStreamConfig(batch=batch, per_step=per_step))
    return dataclasses.replace(c, local=dataclasses.replace(c.local, keep_bases=keep),
                               remote=dataclasses.replace(c.remote, keep_bases=remote_keep, base_every=every))


def _watermark(c: CheckpointConfig, s: int):
    """The newest base on Tier-3 (every base_every-th) that the reclaim at batch end ``s`` knows committed."""
    durable = c.remote.base_every * c.base_interval
    learned = [v for v in range(0, s + 1, durable) if v + COMMIT_LAG_BATCHES * c.diff.batch <= s]
    return learned[-1] if learned else None


def _peaks(held: set, peaks: dict) -> None:
    diffs = [p for p in held if p.kind not in (BASE, STEP)]
    for key, value in (("bases", sum(p.kind == BASE for p in held)), ("step_units", sum(p.kind == STEP for p in held)),
                       ("diff_steps", sum(p.last - p.first + 1 for p in diffs))):
        peaks[key] = max(peaks.get(key, 0), value)


def _simulate_node(c: CheckpointConfig, tier3_keeps_up: bool, steps: int = 800) -> dict:
    """A rank's node-memory area over ``steps``, the manager's order: the batch closes, the base is written, then
    (at batch ends) the reclaim; the watermark learns base v COMMIT_LAG_BATCHES batches after it, or never."""
    B, b = c.base_interval, c.diff.batch
    held, peaks = {PayloadId.base(0)}, {}
    for s in range(1, steps + 1):
        if s % b == 0:
            held = {p for p in held if not (p.kind == STEP and p.first > s - b)} | {PayloadId.diff(s - b + 1, s)}
        elif c.diff.per_step:
            held.add(PayloadId.step(s))
        if s % B == 0:
            held.add(PayloadId.base(s))
        _peaks(held, peaks)
        if s % b == 0:
            watermark = _watermark(c, s) if tier3_keeps_up else None
            held -= local_reclaim_set(held, node_memory_floor(watermark, retention_floor(held, c.local.keep_bases)))
    return peaks


def _simulate_tier3(c: CheckpointConfig, steps: int = 800) -> dict:
    """Tier-3: batches committed as they close, every base_every-th base uploading from its step and committed a
    batch later; reclaimed when the watermark moves (COMMIT_LAG_BATCHES batches after the base)."""
    durable, b = c.remote.base_every * c.base_interval, c.diff.batch
    units, peaks, watermark = {PayloadId.base(0): False}, {}, None
    for s in range(1, steps + 1):
        if s % b == 0:
            units[PayloadId.diff(s - b + 1, s)] = True
        if s % durable == 0:
            units[PayloadId.base(s)] = False
        for pid in units:
            if pid.kind == BASE and pid.version + b <= s:
                units[pid] = True
        _peaks(set(units), peaks)
        if _watermark(c, s) not in (None, watermark):
            watermark = _watermark(c, s)
            for pid in remote_reclaim_set(units, watermark, c.remote.keep_bases):
                del units[pid]
    return peaks


@pytest.mark.parametrize("kw", [{}, {"keep": 1}, {"keep": 3}, {"interval": 20, "batch": 4}, {"per_step": False},
                                {"remote_keep": 1}, {"remote_keep": 3}, {"interval": 10, "batch": 10},
                                {"interval": 15, "batch": 5, "keep": 1}, {"interval": 12, "batch": 4, "keep": 3},
                                {"interval": 8, "batch": 2, "remote_keep": 1}, {"every": 2}, {"every": 3, "keep": 3},
                                {"every": 4, "interval": 10, "remote_keep": 1}])
def test_retention_is_what_the_reclaim_policy_keeps(kw):
    c = _config(**kw)
    r = retention(c)
    assert _simulate_node(c, tier3_keeps_up=True) == dataclasses.asdict(r["node"])
    assert _simulate_node(c, tier3_keeps_up=False) == dataclasses.asdict(r["node_bound"])
    assert _simulate_tier3(c) == dataclasses.asdict(r["tier3"])


def test_without_tier3_node_memory_keeps_its_bound():
    c = dataclasses.replace(_config(), tiers=["local", "peer"])
    assert retention(c)["node"] == retention(c)["node_bound"]


# ---- the plan and its command -------------------------------------------------------------------------------

def test_plan_of_a_two_node_job(tiny_config):
    cfg = tiny_config("checkpoint=tiered", "checkpoint.base_interval=10")
    sp = plan(cfg, Cluster(2, 1))
    assert [r.layout.dp_rank for r in sp.ranks] == [0, 1] and [r.node for r in sp.ranks] == [0, 1]
    assert sum(r.shard_numel for r in sp.ranks) >= 130_000  # the tiny model, padded to two equal shards
    for r in sp.ranks:
        assert r.base > 12 * r.shard_numel and r.diff_batch > 5 * r.step_unit / 2 > 0
    ret = sp.retention
    own = [ret["node"].bytes(r, 5) for r in sp.ranks]
    assert sp.node_bytes(0, "node") == sp.node_bytes(1, "node") == sum(own)  # own rank + the other's replica
    assert sp.tier3_bytes() == sum(ret["tier3"].bytes(r, 5) for r in sp.ranks)
    one_node = plan(cfg, Cluster(1, 2))
    assert "peer" not in one_node.ckpt.tiers and one_node.node_bytes(0, "node") == sum(own)
    assert one_node.notes and "peer tier is skipped" in one_node.notes[0]


def test_plan_refuses_what_cannot_run(tiny_config):
    with pytest.raises(PlanError, match="not divisible by parallel.tp=2"):
        plan(tiny_config("checkpoint=tiered", "parallel.tp=2"), Cluster(3, 1))
    with pytest.raises(PlanError, match="checkpointing is off"):
        plan(tiny_config(), Cluster(1, 1))


def test_inspect_plan_prints_ranks_tiers_and_nodes(corpus_prefix, capsys):
    common = ["--", "model=tiny", f"data.prefix={corpus_prefix}", "train.global_batch_size=8", "parallel.tp=2"]
    assert inspect_main(["--plan", "--nodes", "2", "--procs-per-node", "2", *common]) == 0
    out = capsys.readouterr().out
    assert "tp=2 pp=1 dp=2 on 2 nodes x 2 processes" in out and f"vocabulary 257 from {corpus_prefix}.idx" in out
    assert "note: the vocabulary (and so the parameter count) is the data's, 257 tokens" in out
    for needle in ("payloads per rank", "Tier-1 node memory: 2 bases + 60 steps", "Tier-2: the same", "Tier-3: 3 "
                   "bases + 110 steps", "node memory per node", "Tier-3 (", "for the whole job"):
        assert needle in out, needle
    assert inspect_main(["--plan", "--nodes", "3", *common]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "world size 3 is not divisible" in err
    assert inspect_main(["--plan", "--", "model=nonexistent"]) == 2
    assert "Could not find 'model/nonexistent'" in capsys.readouterr().err
