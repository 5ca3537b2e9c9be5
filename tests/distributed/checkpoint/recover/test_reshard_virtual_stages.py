"""A checkpoint of a pp=2 x v=2 job (interleaved schedule) restores at plain pp=2 and back, by resharding.

With two model chunks per rank, rank 0 holds layers 0 and 2 where plain pp=2 has it hold 0 and 1: the same
degrees, other layers. The point's parallel.virtual_stages (from its config record) differs from the job's, so
restore reshards by parameter name. Each relaunch's canonical digest right after restore (its recovery
record's) equals the state the previous run ended with, and the record says it was resharded. Lossless diffs,
bases at 0 and 6, batches of 2, no final base: each restore replays a chain after its base.
"""
from __future__ import annotations

import json
import os

import pytest

from megatier.training.trainer import Trainer
from tests.distributed.configs import tiny_job
from tests.distributed.world import run_world

pytestmark = pytest.mark.timeout(240)  # three worlds in a row, on a loaded box
JOB = "chunksjob"


def _run(rank: int, tmp: str, prefix: str, run: str, v: int, iters: int) -> dict:
    cfg = tiny_job(tmp, JOB, prefix, iters=iters, pp=2, run=run, model={"num_layers": 4},
                   checkpoint={"final_base": False})
    cfg.parallel.virtual_stages = v
    trainer = Trainer(cfg)
    trainer.train()  # restores first
    out = {"digest": trainer.close()["canonical_digest"]}
    with open(os.path.join(tmp, run, "metrics.jsonl")) as f:
        out["record"] = next((json.loads(line) for line in f if '"recovery"' in line), None)
    return out


def test_interleaved_checkpoint_reshards_to_plain_pp_and_back(corpus_prefix, tmp_path):
    tmp = str(tmp_path)
    first = run_world(_run, 2, tmp_path, tmp, corpus_prefix, "v2", 2, 8, timeout_s=60)
    plain = run_world(_run, 2, tmp_path, tmp, corpus_prefix, "v1", 1, 11, timeout_s=60)
    back = run_world(_run, 2, tmp_path, tmp, corpus_prefix, "v2again", 2, 14, timeout_s=60)
    assert first[0]["record"] is None
    for run, before, step in ((plain, first, 8), (back, plain, 11)):
        record = run[0]["record"]
        assert record["step"] == step and record["resharded"] == "(1,2,1) -> (1,2,1)"
        assert record["canonical_digest"] == before[0]["digest"]  # the state right after restore
