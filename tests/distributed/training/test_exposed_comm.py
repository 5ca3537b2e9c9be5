"""A step's record says how long it waited for communication: with one rank made slow, the other's
``dp_wait_ms`` (dp=2: the gradient reduce-scatter waits for the slow rank's backward) or ``pp_bubble_ms``
(pp=2: the first stage waits for the slow last stage's gradients) holds at least the delay; the other field is 0."""
from __future__ import annotations

import time

import pytest

from megatier.training.trainer import Trainer
from tests.distributed.configs import tiny_job
from tests.distributed.world import run_world

pytestmark = pytest.mark.timeout(120)
DELAY_S = 0.3  # far above the two ranks' own difference in speed on a loaded machine


def _slowed(rank: int, tmp: str, prefix: str, pp: int) -> dict:
    trainer = Trainer(tiny_job(tmp, f"exposed-pp{pp}", prefix, iters=2, pp=pp, run=f"run-pp{pp}"))
    if rank == 1:
        if pp == 1:  # after the backward, before the reduce-scatter
            sync = trainer._sync_copies
            trainer._sync_copies = lambda: (time.sleep(DELAY_S), sync())
        else:  # the last stage's head, once a step (its first micro-batch's)
            head, calls = trainer.model.head, [0]

            def slow_head(*args):
                calls[0] += 1
                if calls[0] % 4 == 1:
                    time.sleep(DELAY_S)
                return head(*args)
            trainer.model.head = slow_head
    trainer.train()
    record = trainer.last_record
    trainer.close()
    return {key: record[key] for key in ("dp_wait_ms", "dp_grad_wait_ms", "dp_param_wait_ms", "pp_bubble_ms")}


def test_a_slow_rank_shows_as_its_peer_s_dp_wait(corpus_prefix, tmp_path):
    fast, _ = run_world(_slowed, 2, tmp_path, str(tmp_path), corpus_prefix, 1)
    assert fast["dp_grad_wait_ms"] >= 0.5 * DELAY_S * 1000
    assert fast["dp_param_wait_ms"] > 0.0
    assert fast["dp_wait_ms"] == fast["dp_grad_wait_ms"] + fast["dp_param_wait_ms"]
    assert fast["pp_bubble_ms"] == 0.0


@pytest.mark.slow
def test_a_slow_last_stage_shows_as_the_first_stage_s_bubble(corpus_prefix, tmp_path):
    first, _ = run_world(_slowed, 2, tmp_path, str(tmp_path), corpus_prefix, 2)
    assert first["pp_bubble_ms"] >= 0.5 * DELAY_S * 1000
    assert first["dp_wait_ms"] == 0.0
