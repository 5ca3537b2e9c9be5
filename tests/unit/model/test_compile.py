"""model.compile: compiled blocks train bitwise as eager blocks (with dropout, under each recomputation), and a
compiled run's checkpoint saves and restores the states an eager run's does.

The backend is aot_eager: Dynamo and AOTAutograd trace forward and backward exactly as for inductor, and the
traced graphs run as eager ops, so the comparison can be bitwise and the test takes seconds. Inductor is left out
of the suite: its C++ compilation of even the tiny model's block takes about 25 s on this 2-core machine (the
first step of bench_exposure.py's compile part), and its fused kernels round differently (equal to eager within
fp32 rounding, not bitwise); the GPU check's throughput phase runs it."""
from __future__ import annotations

import pytest
from torch._dynamo.utils import counters

from megatier.model.compile import compile_blocks
from tests.unit.training.runs import train_records

pytestmark = pytest.mark.timeout(240)
TINY = ("train.iters=2", "train.eval_interval=100", "model.hidden_dropout=0.1", "model.attention_dropout=0.1")
COMPILED = ("model.compile=true", "model.compile_backend=aot_eager")


def _digest_and_losses(records: list[dict]) -> tuple[str, list[float]]:
    return records[-1]["state_digest"], [r["loss"] for r in records if "event" not in r]


@pytest.mark.parametrize("recompute", ["selective", "full"])  # "none": the checkpoint test's runs
def test_compiled_blocks_train_bitwise_as_eager(tiny_config, tmp_path, recompute):
    eager = train_records(tiny_config(*TINY, f"model.recompute={recompute}", f"logging.run_dir={tmp_path / 'e'}"))
    counters.clear()
    compiled = train_records(tiny_config(*TINY, *COMPILED, f"model.recompute={recompute}",
                                         f"logging.run_dir={tmp_path / 'c'}"))
    assert counters["stats"]["unique_graphs"] >= 1  # Dynamo did trace the blocks
    assert _digest_and_losses(compiled) == _digest_and_losses(eager)


def test_a_compiled_run_saves_and_restores_as_an_eager_run(tiny_config, tmp_path):
    def saved_then_resumed(name: str, *compiled: str) -> list[str]:
        ckpt = ("checkpoint.enabled=true", f"checkpoint.job_id={name}", "checkpoint.base_interval=2",
                "checkpoint.capture_steps=2", "checkpoint.diff.batch=1", "checkpoint.diff.compression=fp32",
                f"checkpoint.local.root={tmp_path / name / 'shm'}", f"checkpoint.remote.url={tmp_path / name / 'r'}")
        saved = train_records(tiny_config(*TINY, *compiled, *ckpt, f"logging.run_dir={tmp_path / name / 'a'}"))
        resumed = train_records(tiny_config(*TINY, *compiled, *ckpt, "train.iters=3",
                                            f"logging.run_dir={tmp_path / name / 'b'}"))
        assert next(r for r in resumed if r.get("event") == "recovery")["step"] == 2
        return [saved[-1]["state_digest"], resumed[-1]["state_digest"]]

    assert saved_then_resumed("compiled", *COMPILED) == saved_then_resumed("eager")


def test_an_unknown_backend_names_the_key():
    from torch import nn
    with pytest.raises(ValueError, match="model.compile_backend='fast'"):
        compile_blocks(nn.ModuleDict({"0": nn.Linear(2, 2)}), "fast")
