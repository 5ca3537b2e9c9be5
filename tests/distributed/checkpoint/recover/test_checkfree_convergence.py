"""CheckFree's rebuild against its baselines (Figure 2 of CheckFree, arXiv:2506.15461), at a size CI can run.

A tiny GPT (4 layers, hidden 64) on pp=4 trains 400 steps on 8 MiB of the standard library (byte level, as the
default corpus) with Tier-1 checkpointing; then stage 2 loses every copy. Four relaunches from copies of the same
node memory restore step 400 and train 5 more steps: nothing lost (the fault-free run), and stage 2 rebuilt as
CheckFree's weighted average, a copy of stage 1, a fresh initialisation. The fault-free run must have the
lowest validation loss right after the recovery and 5 steps later; CheckFree's average must be the lowest of the
rebuilds right after the recovery (by 0.003 over the copy, seed 7), and 5 steps later below the fresh
initialisation and within 0.001 of the best rebuild. By then the average and the copy are 0.0002 apart, and
their order depends on the machine's float paths: on one 2-core box the average was ahead, on another the copy
(2.10662 vs 2.10646, the same numbers with the code of either side of a change).

Copy against fresh initialisation is not asserted: at this size their order depends on the seed (copy ahead in
4 of 6 runs tried: seeds 1234, 7, 11, 3 in benchmarks/bench_checkfree.py, 7 and 11 here). The longer experiment,
where the stage matters more, is ``benchmarks/bench_checkfree.py``; its table is in docs/benchmarks.md.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from megatier.config import (
    Config,
)
from megatier.data.corpus import build_dataset, stdlib_files
from megatier.training.trainer import Trainer
from tests.distributed.configs import tiny_job
from tests.distributed.world import run_world

pytestmark = pytest.mark.timeout(600)
JOB, FAIL, AFTER, LOST, SEED = "cfconv", 400, 5, 2, 7


def _config(tmp: str, memory: str, iters: int, init: str, seed: int) -> Config:
    return tiny_job(tmp, JOB, Path(tmp, "corpus.txt").read_text(), iters=iters, pp=4, run=f"run-{memory}", seq_len=64,
                    model={"name": "tiny", "num_layers": 4, "hidden_size": 64, "max_position_embeddings": 128},
                    optim={"warmup_iters": 20, "decay_iters": FAIL + AFTER},
                    train={"seed": seed, "eval_iters": 32},
                    checkpoint={"tiers": ["local"], "base_interval": 50, "diff": {"batch": 5},
                                "local": {"root": os.path.join(tmp, memory)}, "last_resort": "checkfree",
                                "checkfree": {"init": init}})

def _train(rank: int, tmp: str, seed: int) -> None:
    os.environ["MEGATIER_NODE_NAME"] = "node0"
    trainer = Trainer(_config(tmp, "shm", FAIL, "weighted", seed))
    trainer.train()
    trainer.close()


def _resume(rank: int, tmp: str, memory: str, init: str, seed: int) -> tuple[float, float]:
    """Validation loss right after the recovery and AFTER steps later."""
    os.environ["MEGATIER_NODE_NAME"] = "node0"
    trainer = Trainer(_config(tmp, memory, FAIL + AFTER, init, seed))
    trainer.restore()
    assert trainer.step == FAIL
    at_recovery = trainer.evaluate()
    trainer.train()
    later = trainer.evaluate()
    trainer.close()
    return at_recovery, later


def losses_after_loss(tmp_path: Path, seed: int) -> dict[str, tuple[float, float]]:
    """Each variant's validation loss (right after the recovery, AFTER steps later); corpus.txt in tmp_path."""
    tmp = str(tmp_path)
    run_world(_train, 4, tmp_path, tmp, seed, timeout_s=300)
    losses = {}
    for variant in ("fault-free", "weighted", "copy", "random"):
        memory = f"shm-{variant}"
        shutil.copytree(tmp_path / "shm", tmp_path / memory)
        if variant != "fault-free":
            shutil.rmtree(tmp_path / memory / JOB / "node0" / "own" / f"rank{LOST:05d}")
        init = "weighted" if variant == "fault-free" else variant
        losses[variant] = run_world(_resume, 4, tmp_path, tmp, memory, init, seed, timeout_s=300)[0]
    return losses


@pytest.mark.slow
def test_the_weighted_average_is_the_best_rebuild(tmp_path):
    prefix = str(tmp_path / "stdlib_8mib")
    build_dataset(stdlib_files(8 * 2**20), prefix, tokenizer="byte")
    (tmp_path / "corpus.txt").write_text(prefix)
    losses = losses_after_loss(tmp_path, SEED)
    at_recovery = sorted(losses, key=lambda v: losses[v][0])
    assert at_recovery[:2] == ["fault-free", "weighted"], losses
    later = {v: loss[1] for v, loss in losses.items()}
    assert min(later, key=later.get) == "fault-free", losses
    assert later["weighted"] < later["random"], losses
    assert later["weighted"] <= min(later["copy"], later["random"]) + 1e-3, losses
