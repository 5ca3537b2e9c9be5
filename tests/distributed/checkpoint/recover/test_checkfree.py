"""CheckFree: a pipeline stage lost from every tier is rebuilt from its neighbours, and the run goes on.

A tiny GPT of 4 layers on pp=4 (one layer per stage) trains E steps with Tier-1 and Tier-3 (lossless diffs),
then stage 2 loses every copy: its Tier-1 area and its Tier-3 objects are deleted (its Tier-3 units stay
committed, so restore only finds them missing when it reads them). Relaunched with
``checkpoint.last_resort=checkfree``:
- the other stages resume exactly at E (no step lost); stage 2's weights equal, bit for bit, the average of
  stage 1's and stage 3's layer at E weighted by their last squared gradient norms; its Adam moments and count
  start at zero and its lr is the schedule's times 1.1;
- the recovery record and every later step record say the state is not exact;
- with the default ``last_resort=stop`` the same relaunch stops, naming the lost stage.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from megatier.checkpoint.recover.checkfree import mix
from megatier.checkpoint.recover.inventory import RecoveryError
from megatier.config import (
    CheckFreeConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    DiffStreamConfig,
    LocalTierConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RemoteTierConfig,
    TrainConfig,
    WandbConfig,
)
from megatier.training.trainer import Trainer
from tests.distributed.world import run_world

pytestmark = pytest.mark.timeout(300)
JOB, E, MORE, LOST = "checkfreejob", 8, 3, 2


def _config(tmp: str, run: str, iters: int, last_resort: str = "stop") -> Config:
    return Config(
        model=ModelConfig(name="tiny4", num_layers=4, hidden_size=32, num_heads=4, max_position_embeddings=32),
        parallel=ParallelConfig(tp=1, pp=4, timeout_s=60.0),
        optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_iters=2, decay_iters=20, clip_grad=1.0),
        data=DataConfig(prefix=Path(tmp, "corpus.txt").read_text(), seq_len=32),
        train=TrainConfig(iters=iters, global_batch_size=8, micro_batch_size=2, seed=5, device="cpu", threads=1,
                          eval_interval=10**6, eval_iters=1),
        checkpoint=CheckpointConfig(enabled=True, tiers=["local", "remote"], base_interval=6, job_id=JOB,
                                    diff=DiffStreamConfig(batch=2, compression="fp32"),
                                    local=LocalTierConfig(root=os.path.join(tmp, "shm")),
                                    remote=RemoteTierConfig(url=os.path.join(tmp, "remote")),
                                    last_resort=last_resort, checkfree=CheckFreeConfig(lr_scale=1.1)),
        logging=LoggingConfig(name=JOB, run_dir=os.path.join(tmp, run), progress=False,
                              wandb=WandbConfig(mode="disabled")),
    )


def _first_run(rank: int, tmp: str) -> dict:
    os.environ["MEGATIER_NODE_NAME"] = "node0"
    trainer = Trainer(_config(tmp, "first", E))
    trainer.train()
    out = {"params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
           "sumsq": float(trainer.optimizer.last_sumsq)}
    trainer.close()
    return out


def _relaunch(rank: int, tmp: str, last_resort: str) -> dict:
    os.environ["MEGATIER_NODE_NAME"] = "node0"
    trainer = Trainer(_config(tmp, f"again-{last_resort}", E + MORE, last_resort))
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


def test_a_lost_intermediate_stage_is_rebuilt_from_its_neighbours(corpus_prefix, tmp_path):
    (tmp_path / "corpus.txt").write_text(corpus_prefix)
    tmp = str(tmp_path)
    before = run_world(_first_run, 4, tmp_path, tmp, timeout_s=120)
    _lose_stage(tmp, [LOST])

    stopped = run_world(_relaunch, 4, tmp_path, tmp, "stop", timeout_s=120)
    for res in stopped:
        assert "stage(s) [2] lost every copy: checkpoint.last_resort=checkfree" in res["error"], res["error"]

    after = run_world(_relaunch, 4, tmp_path, tmp, "checkfree", timeout_s=120)
    assert [a["step"] for a in after] == [E] * 4, "the other stages must resume at E: no step lost"
    for stage in (0, 1, 3):  # resumed exactly
        for name, p in after[stage]["params"].items():
            assert torch.equal(p, before[stage]["params"][name]), name
    w_prev, w_next = before[LOST - 1]["sumsq"], before[LOST + 1]["sumsq"]
    rebuilt = after[LOST]["params"]
    assert set(rebuilt) == {n.replace("layers.1.", "layers.2.") for n in before[LOST - 1]["params"]}
    for name, p in rebuilt.items():
        a = before[LOST - 1]["params"][name.replace("layers.2.", "layers.1.")]
        b = before[LOST + 1]["params"][name.replace("layers.2.", "layers.3.")]
        assert torch.equal(p, mix([a, b], [w_prev, w_next])), name
        assert not torch.equal(p, before[LOST]["params"][name])
    assert (after[LOST]["moments"], after[LOST]["adam_steps"], after[LOST]["lr_scale"]) == (0.0, 0, 1.1)
    assert after[0]["lr_scale"] == 1.0

    record = after[0]["record"]
    assert record["exact"] is False and record["end"] == E and record["steps_lost"] == 0
    cf = record["checkfree"]
    assert cf["stages"] == [LOST] and cf["init"] == "weighted" and cf["exact"] is False
    assert cf["rebuilds"] == [{"stage": LOST, "neighbours": [1, 3], "weights": [w_prev, w_next], "stand_in": False,
                              "exact_copies": {}}]
    steps = after[0]["steps"]
    assert [s["step"] for s in steps] == list(range(E + 1, E + MORE + 1))
    assert all(s["inexact_since"] == E for s in steps)
    assert all(torch.isfinite(torch.tensor(s["loss"])) for s in steps)
