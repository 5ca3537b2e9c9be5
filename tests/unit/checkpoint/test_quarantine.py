"""A committed Tier-3 unit that fails its checksum at restore is quarantined, reported, and committed anew."""
from __future__ import annotations

import glob
import json
import os

import pytest

from megatier.checkpoint.commit.records import QUARANTINE, list_units
from megatier.checkpoint.format.units import PayloadId
from megatier.checkpoint.tiers.remote import open_remote_store
from megatier.training.trainer import Trainer

pytestmark = pytest.mark.timeout(120)


def _train(cfg) -> list[dict]:
    trainer = Trainer(cfg)
    try:
        trainer.train()
    finally:
        trainer.close()
    with open(f"{cfg.logging.run_dir}/metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_a_corrupt_committed_base_is_quarantined_and_replaced(tiny_config, tmp_path):
    common = ["checkpoint=tiered", "checkpoint.tiers=[local,remote]", f"checkpoint.local.root={tmp_path}/shm",
              f"checkpoint.remote.url={tmp_path}/t3", "checkpoint.base_interval=10", "checkpoint.job_id=q",
              "checkpoint.diff.compression=fp32", "optim.decay_iters=40",
              "checkpoint.diff.per_step=false"]  # E lands on base 10's version, so the resumed run re-bases there
    _train(tiny_config(*common, "train.iters=10"))  # ends on base 10: no open batch, no final base
    for stamp in glob.glob(f"{tmp_path}/shm/q/*/own/*/base/v00000010.json"):
        os.remove(stamp)  # Tier-1 has lost base 10: restore must read Tier-3's copy
    store = open_remote_store(f"{tmp_path}/t3", "q")
    obj = next(k for k in store.list("base/v00000010/") if k.endswith(".safetensors"))
    data = bytearray(store.get(obj))
    data[len(data) // 2] ^= 0xFF
    store.put(obj, bytes(data))
    records = _train(tiny_config(*common, "train.iters=15", f"logging.run_dir={tmp_path}/run2"))
    recovery = next(r for r in records if r.get("event") == "recovery")
    assert (recovery["version"], recovery["end"]) == (0, 10)  # the older committed base and its diffs
    assert recovery["quarantined"] == ["base v10"]
    assert any("base v10" in f and "xxh64" in f for f in recovery["fallbacks"])
    assert any(k.startswith(f"{QUARANTINE}base/v00000010/") for k in store.list(QUARANTINE))
    unit = list_units(store)[PayloadId.base(10)]  # the resumed run's anchor base at 10, committed anew
    assert unit.committed
    assert obj not in unit.objects or store.get(obj) != bytes(data)  # never the corrupt bytes again
