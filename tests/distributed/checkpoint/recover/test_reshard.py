"""Resharding restore: a job relaunched on another layout resumes the old layout's state, bit for bit.

Each case trains a tiny GPT for E steps on the old layout with tiered checkpointing (lossless diffs, bases
at 0 and 6, batches of 2, so the chain V=6 -> E=8 is not empty), simulates a failure on the files, and
relaunches the same job on the new layout:
- the new job's canonical digest right after restore equals the old run's at E (same state, other layout);
- the next 5 steps' losses equal those of a run in the new layout that starts from the old run's state at E
  installed directly (no checkpoint involved);
- the recovery record says what was resharded and where the base came from: Tier-1 (nothing lost),
  Tier-2 (a node's memory lost: its old ranks come from replicas on the other node) and Tier-3 (every
  node's memory lost).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from megatier.checkpoint.shard import ShardAccess
from megatier.config import (
    Config,
)
from megatier.optim.canonical import ShardState, assemble, canonical_digest, cut_shard, shard_pieces
from megatier.training.trainer import Trainer
from tests.distributed.configs import tiny_job
from tests.distributed.world import run_world

pytestmark = pytest.mark.timeout(240)
JOB, E, MORE = "reshardjob", 8, 5


def _config(tmp: str, run: str, degrees: tuple[int, int, int], iters: int, checkpoint: bool = True,
            arch: str = "gpt2") -> Config:
    """A tiny GPT of 3 layers (pp=2 splits it 2 + 1) on the byte corpus; the vocabulary is padded to 384 rows at
    tp=1 and 512 at tp=2, so resharding between them drops and adds padding."""
    tp, pp, _ = degrees
    # No final base: the restore replays the diffs after base 6 into the other layout.
    model = {"arch": "llama", "num_query_groups": 2} if arch == "llama" else None
    return tiny_job(tmp, JOB, Path(tmp, "corpus.txt").read_text(), iters=iters, tp=tp, pp=pp, run=run, model=model,
                    checkpoint={"final_base": False} if checkpoint else None)

def _as_node(rank: int, per_node: int) -> None:
    os.environ.update(MEGATIER_NODE_NAME=f"node{rank // per_node}", LOCAL_RANK=str(rank % per_node),
                      LOCAL_WORLD_SIZE=str(per_node))


def _losses(run_dir: str) -> list[float]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r["loss"] for r in rows if "loss" in r and r.get("step", 0) > E and r.get("event") is None]


def _old_run(rank: int, tmp: str, degrees, per_node: int, arch: str = "gpt2") -> dict:
    _as_node(rank, per_node)
    trainer = Trainer(_config(tmp, "old", degrees, E, arch=arch))
    trainer.train()
    o, ps = trainer.optimizer, trainer.ps
    shard = ShardState(ps.tp_rank, ps.tp, o.shard_segments, {k: v.clone() for k, v in o.state_tensors().items()})
    summary = trainer.close()
    return {"digest": summary["canonical_digest"], "shard": shard, "adam_steps": o.adam_steps}


def _resumed_run(rank: int, tmp: str, degrees, per_node: int, arch: str = "gpt2") -> dict:
    _as_node(rank, per_node)
    trainer = Trainer(_config(tmp, "new", degrees, E + MORE, arch=arch))
    trainer.restore()
    out = {"step": trainer.step, "digest": trainer.canonical_digest()}
    trainer.train()
    trainer.close()
    if rank == 0:
        out["losses"] = _losses(os.path.join(tmp, "new"))
        with open(os.path.join(tmp, "new", "metrics.jsonl")) as f:
            out["record"] = next(json.loads(line) for line in f if '"recovery"' in line)
    return out


def _reference_run(rank: int, tmp: str, degrees, per_node: int, canonical: dict, adam_steps: int) -> dict:
    """The new layout from the old run's state at E, installed directly (checkpointing off)."""
    _as_node(rank, per_node)
    trainer = Trainer(_config(tmp, "reference", degrees, E + MORE, checkpoint=False))
    o, ps = trainer.optimizer, trainer.ps
    tensors = cut_shard(canonical, o.shard_segments, ps.tp_rank, ps.tp, o.master.numel())
    access = ShardAccess(o, trainer.cfg.train.global_batch_size)
    access.load_state(tensors, adam_steps, None, "the reference state")
    access.publish()
    trainer.step = E
    trainer.train()
    trainer.close()
    return {"losses": _losses(os.path.join(tmp, "reference")) if rank == 0 else None}


CASES = {
    # name: (old degrees, old procs per node, new degrees, new procs per node, what fails)
    "tier1": ((2, 2, 1), 2, (1, 1, 4), 2, None),
    "tier2": ((1, 2, 2), 2, (2, 1, 1), 1, "node1"),
    "tier3": ((2, 1, 1), 2, (1, 2, 2), 2, "all"),
}


@pytest.mark.parametrize("case", [c if c == "tier2" else pytest.param(c, marks=pytest.mark.slow)
                                  for c in sorted(CASES)])
def test_resharded_restore_resumes_the_old_layouts_state(case, corpus_prefix, tmp_path):
    old, old_per_node, new, new_per_node, fails = CASES[case]
    (tmp_path / "corpus.txt").write_text(corpus_prefix)
    tmp = str(tmp_path)
    before = run_world(_old_run, int(torch.Size(old).numel()), tmp_path, tmp, old, old_per_node, timeout_s=120)
    assert len({r["digest"] for r in before}) == 1
    if fails == "node1":
        shutil.rmtree(tmp_path / "shm" / JOB / "node1")
    elif fails == "all":
        shutil.rmtree(tmp_path / "shm")
    after = run_world(_resumed_run, int(torch.Size(new).numel()), tmp_path, tmp, new, new_per_node, timeout_s=120)
    for res in after:
        assert res["step"] == E
        assert res["digest"] == before[0]["digest"], "the resharded state differs from the old run's at E"
    record = after[0]["record"]
    assert record["resharded"] == "({},{},{}) -> ({},{},{})".format(*old, *new)
    assert record["decided_by"] == "rank 0"  # another layout: the node summaries leave it to the whole inventory
    assert (record["version"], record["end"]) == (6, E)
    assert record["source_tiers"][case] > 0, record["source_tiers"]
    if case != "tier3":
        assert record["bytes_tier3"] == 0

    canonical = assemble([p for r in before for p in shard_pieces(r["shard"])])
    assert canonical_digest(canonical) == before[0]["digest"]
    ref = run_world(_reference_run, int(torch.Size(new).numel()), tmp_path, tmp, new, new_per_node, canonical,
                    before[0]["adam_steps"], timeout_s=120)
    losses, want = after[0]["losses"], ref[0]["losses"]
    assert len(losses) == MORE and len(want) == MORE
    torch.testing.assert_close(losses, want, rtol=1e-5, atol=0.0)


@pytest.mark.slow
def test_a_llama_job_reshards_tp2_dp2_to_tp1_dp2_with_the_same_canonical_digest(corpus_prefix, tmp_path):
    """model.arch=llama: the stacked k/v and gate/up weights and the untied head reshard like any parameter."""
    (tmp_path / "corpus.txt").write_text(corpus_prefix)
    tmp = str(tmp_path)
    before = run_world(_old_run, 4, tmp_path, tmp, (2, 1, 2), 2, "llama", timeout_s=120)
    after = run_world(_resumed_run, 2, tmp_path, tmp, (1, 1, 2), 1, "llama", timeout_s=120)
    assert len({r["digest"] for r in before}) == 1
    for res in after:
        assert res["step"] == E and res["digest"] == before[0]["digest"]
    assert after[0]["record"]["resharded"] == "(2,1,2) -> (1,1,2)"
