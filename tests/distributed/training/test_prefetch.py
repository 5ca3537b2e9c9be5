"""Prefetching changes neither the samples nor the state: a dp=2 job trains to the same state digest with
data.prefetch on and off, each rank reading the same samples each step, and a job stopped after step 5 (its
loader had read step 6 ahead) resumes with step 6's samples and ends in the same state."""
from __future__ import annotations

import hashlib

import pytest

from megatier.training.trainer import Trainer
from tests.distributed.configs import tiny_job
from tests.distributed.world import run_world

pytestmark = pytest.mark.timeout(240)
STEPS, STOP = 8, 5


def _config(tmp: str, run: str, prefix: str, prefetch: bool, checkpoint: bool):
    cfg = tiny_job(tmp, "prefetch", prefix, iters=STEPS, run=run,
                   checkpoint={"base_interval": 4} if checkpoint else None)
    cfg.data.prefetch = prefetch
    return cfg


def _recording(trainer: Trainer, seen: dict) -> None:
    """Record a digest of the inputs of every step's micro-batches, as the step reads them."""
    read = trainer.batches.train_microbatches

    def train_microbatches(step: int):
        batches = read(step)
        seen[step] = hashlib.sha256(b"".join(x.numpy().tobytes() for x, _ in batches)).hexdigest()
        return batches
    trainer.batches.train_microbatches = train_microbatches


def _run(rank: int, tmp: str, run: str, prefix: str, prefetch: bool) -> dict:
    trainer, seen = Trainer(_config(tmp, run, prefix, prefetch, False)), {}
    _recording(trainer, seen)
    trainer.train()
    waits = [trainer.last_record["data_wait_ms"]]
    return {"digest": trainer.close()["state_digest"], "seen": seen, "waits": waits}


def _stopped(rank: int, tmp: str, prefix: str) -> dict:
    """Steps 1..STOP, then close, as a stop request would end the launch."""
    trainer, seen = Trainer(_config(tmp, "resumed", prefix, True, True)), {}
    _recording(trainer, seen)
    trainer.restore()
    for _ in range(STOP):
        trainer._loop_step()
    ahead = trainer.batches._ahead[0]  # what the loader read past the stop
    trainer.close()
    return {"seen": seen, "ahead": ahead}


def _resumed(rank: int, tmp: str, prefix: str) -> dict:
    trainer, seen = Trainer(_config(tmp, "resumed", prefix, True, True)), {}
    _recording(trainer, seen)
    trainer.train()
    return {"digest": trainer.close()["state_digest"], "seen": seen}


def test_prefetch_on_and_off_and_a_resume_give_the_same_samples_and_state(corpus_prefix, tmp_path):
    tmp = str(tmp_path)
    on = run_world(_run, 2, tmp_path, tmp, "on", corpus_prefix, True)
    off = run_world(_run, 2, tmp_path, tmp, "off", corpus_prefix, False)
    for a, b in zip(on, off):
        assert a["digest"] == b["digest"]
        assert a["seen"] == b["seen"] and sorted(a["seen"]) == list(range(1, STEPS + 1))
        assert a["waits"][0] >= 0.0
    assert on[0]["seen"] != on[1]["seen"]  # each dp rank its own share
    stopped = run_world(_stopped, 2, tmp_path, tmp, corpus_prefix)
    resumed = run_world(_resumed, 2, tmp_path, tmp, corpus_prefix)
    for rank, (a, b) in enumerate(zip(stopped, resumed)):
        assert a["ahead"] == STOP + 1 and sorted(b["seen"]) == list(range(STOP + 1, STEPS + 1))
        assert {**a["seen"], **b["seen"]} == on[rank]["seen"]
        assert b["digest"] == on[rank]["digest"]
