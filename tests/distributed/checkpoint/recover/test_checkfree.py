"""CheckFree: a pipeline stage lost from every tier is rebuilt from its neighbours, and the run goes on.

A tiny GPT with one layer per model chunk (pp=4, pp=3 with tp=2 or dp=2, and pp=4 with two model chunks per
stage, parallel.virtual_stages=2) trains E steps with Tier-1 and Tier-3 (lossless diffs), then an intermediate
stage loses every copy: its Tier-1 area and its Tier-3 objects are
deleted (its Tier-3 units stay committed, so restore only finds them missing when it reads them). Relaunched with
``checkpoint.last_resort=checkfree``:
- the other stages resume exactly at E (no step lost); the lost stage's weights equal, bit for bit and on each
  tp rank, the average of its neighbours' layer at E (in the same model chunk) weighted by their last squared
  gradient norms (each the sum over the stage's ranks); its Adam moments and count
  start at zero and its lr is the schedule's times 1.1;
- the recovery record and every later step record say the state is not exact;
- with the default ``last_resort=stop`` the same relaunch stops, naming the lost stage.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from megatier.checkpoint.recover.checkfree import mix
from megatier.checkpoint.recover.inventory import RecoveryError
from megatier.config import (
    Config,
)
from megatier.parallel.interleaved import chunk_layers
from megatier.training.trainer import Trainer
from tests.distributed.configs import tiny_job
from tests.distributed.world import run_world

pytestmark = pytest.mark.timeout(300)
JOB, E, MORE = "checkfreejob", 8, 3
# (tp, pp, dp), the lost stage, parallel.virtual_stages
CASES = {"pp4": ((1, 4, 1), 2, 1), "tp2": ((2, 3, 1), 1, 1), "dp2": ((1, 3, 2), 1, 1), "pp4v2": ((1, 4, 1), 1, 2)}


def _config(tmp: str, run: str, iters: int, degrees, v: int, last_resort: str = "stop") -> Config:
    tp, pp, _ = degrees
    cfg = tiny_job(tmp, JOB, Path(tmp, "corpus.txt").read_text(), iters=iters, tp=tp, pp=pp, run=run,
                   model={"name": "tiny", "num_layers": pp * v},
                   checkpoint={"tiers": ["local", "remote"], "last_resort": last_resort,
                               "checkfree": {"lr_scale": 1.1}})
    cfg.parallel.virtual_stages = v
    return cfg


def _counterpart(name: str, stage: int, neighbour: int, pp: int, v: int) -> str:
    """The parameter of ``neighbour`` that stands for ``stage``'s ``name``: the same place in the same chunk."""
    chunks = [chunk_layers(num_layers=pp * v, pp=pp, virtual_stages=v, rank=s) for s in (stage, neighbour)]
    to = {a: b for mine, theirs in zip(*chunks) for a, b in zip(mine, theirs)}
    layer, rest = re.fullmatch(r"layers\.(\d+)\.(.+)", name).groups()
    return f"layers.{to[int(layer)]}.{rest}"


def _first_run(rank: int, tmp: str, degrees, v: int) -> dict:
    os.environ["MEGATIER_NODE_NAME"] = "node0"
    trainer = Trainer(_config(tmp, "first", E, degrees, v))
    trainer.train()
    out = {"params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
           "sumsq": float(trainer.optimizer.last_sumsq), "stage": trainer.ps.pp_rank, "tp_rank": trainer.ps.tp_rank}
    trainer.close()
    return out


def _relaunch(rank: int, tmp: str, degrees, v: int, last_resort: str) -> dict:
    os.environ["MEGATIER_NODE_NAME"] = "node0"
    trainer = Trainer(_config(tmp, f"again-{last_resort}", E + MORE, degrees, v, last_resort))
    try:
        trainer.restore()
    except RecoveryError as e:
        trainer.checkpointer = None  # restore closed it
        return {"error": str(e)}
    o = trainer.optimizer
    out = {"step": trainer.step, "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
           "moments": float(o.exp_avg.abs().sum() + o.exp_avg_sq.abs().sum()), "adam_steps": o.adam_steps,
           "lr_scale": o.lr_scale}
    trainer.train()
    out["lr_last"] = trainer.last_record["lr"]
    trainer.close()
    if rank == 0:
        with open(os.path.join(tmp, f"again-{last_resort}", "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        out["record"] = next(r for r in rows if r.get("event") == "recovery")
        out["steps"] = [r for r in rows if "loss" in r and r.get("event") is None]
    return out


def _lose_stage(tmp: str, ranks: list[int]) -> None:
    """Every copy of ``ranks``' units: their Tier-1 areas and their Tier-3 objects (commit records kept)."""
    for r in ranks:
        shutil.rmtree(os.path.join(tmp, "shm", JOB, "node0", "own", f"rank{r:05d}"))
        gone = glob.glob(os.path.join(tmp, "remote", JOB, "*", "*", f"rank{r:05d}.*"))
        assert gone, f"rank {r} has no Tier-3 object to delete"
        for path in gone:
            os.remove(path)


@pytest.mark.parametrize("case", [c if c == "dp2" else
                                  pytest.param(c, marks=[pytest.mark.slow, pytest.mark.timeout(240)])
                                  for c in sorted(CASES)])
def test_a_lost_intermediate_stage_is_rebuilt_from_its_neighbours(case, corpus_prefix, tmp_path):
    degrees, lost, v = CASES[case]
    world = degrees[0] * degrees[1] * degrees[2]
    (tmp_path / "corpus.txt").write_text(corpus_prefix)
    tmp = str(tmp_path)
    before = run_world(_first_run, world, tmp_path, tmp, degrees, v, timeout_s=120)
    _lose_stage(tmp, [r for r in range(world) if before[r]["stage"] == lost])

    if case == "pp4":
        stopped = run_world(_relaunch, world, tmp_path, tmp, degrees, v, "stop", timeout_s=120)
        for res in stopped:
            assert f"stage(s) [{lost}] lost every copy: checkpoint.last_resort=checkfree" in res["error"], res["error"]

    after = run_world(_relaunch, world, tmp_path, tmp, degrees, v, "checkfree", timeout_s=120)
    assert [a["step"] for a in after] == [E] * world, "the other stages must resume at E: no step lost"
    weight = {s: sum(b["sumsq"] for b in before if b["stage"] == s) for s in (lost - 1, lost + 1)}
    for rank, res in enumerate(after):
        if before[rank]["stage"] != lost:  # resumed exactly
            assert all(torch.equal(p, before[rank]["params"][n]) for n, p in res["params"].items())
            assert res["lr_scale"] == 1.0
            continue
        side = {s: next(b["params"] for b in before if b["stage"] == s and b["tp_rank"] == before[rank]["tp_rank"])
                for s in weight}
        for name, p in res["params"].items():
            a, b = (side[s][_counterpart(name, lost, s, degrees[1], v)] for s in (lost - 1, lost + 1))
            assert torch.equal(p, mix([a, b], [weight[lost - 1], weight[lost + 1]])), name
            assert not torch.equal(p, before[rank]["params"][name])
        assert (res["moments"], res["adam_steps"], res["lr_scale"]) == (0.0, 0, 1.1)

    record = after[0]["record"]
    assert record["exact"] is False and record["end"] == E and record["steps_lost"] == 0
    cf = record["checkfree"]
    assert cf["stages"] == [lost] and cf["init"] == "weighted" and cf["exact"] is False
    assert cf["rebuilds"] == [{"stage": lost, "neighbours": [lost - 1, lost + 1],
                               "weights": [weight[lost - 1], weight[lost + 1]], "stand_in": False,
                               "exact_copies": {}}]
    steps = after[0]["steps"]
    assert [s["step"] for s in steps] == list(range(E + 1, E + MORE + 1))
    assert all(s["inexact_since"] == E for s in steps)
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in steps)
