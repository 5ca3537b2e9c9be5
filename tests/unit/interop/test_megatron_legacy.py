"""Megatron-LM legacy checkpoints (mp_rank_XX/model_optim_rng.pt) written by megatron-core GPTModels built on CPU
at tp=2 and tp=1 (use_cpu_initialization cuts the same full tensors): the tp=2 slices joined are the tp=1 model."""
from __future__ import annotations

import argparse
import os
from functools import partial

import pytest
import torch

from megatier.config import ModelConfig
from megatier.interop.job_state import JobFormatError
from megatier.interop.megatron_legacy import load_megatron_legacy
from tests.distributed.world import run_world

pytest.importorskip("megatron.core")

MODEL = ModelConfig(name="mc", num_layers=2, hidden_size=32, num_heads=4, max_position_embeddings=32)
VOCAB = 250


def _save(rank: int, tp: int, save: str) -> None:
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    mpu.initialize_model_parallel(tp, 1)
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            tensor_model_parallel_size=tp,
                            activation_func=partial(torch.nn.functional.gelu, approximate="tanh"))
    model = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=256, max_sequence_length=32,
                     position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True)
    where = os.path.join(save, "iter_0000005", f"mp_rank_{rank:02d}")
    os.makedirs(where, exist_ok=True)
    torch.save({"iteration": 5, "checkpoint_version": 3.0, "model": model.state_dict(),
                "args": argparse.Namespace(consumed_train_samples=40)}, os.path.join(where, "model_optim_rng.pt"))
    if rank == 0:
        with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("5")
    mpu.destroy_model_parallel()


@pytest.mark.timeout(240)  # two worlds in a row, each importing megatron-core: 33 s alone, 120 on a loaded box
def test_tp2_slices_join_into_the_tp1_model(tmp_path):
    run_world(_save, 2, tmp_path, 2, str(tmp_path / "tp2"), timeout_s=110)
    run_world(_save, 1, tmp_path, 1, str(tmp_path / "tp1"), timeout_s=110)
    two = load_megatron_legacy(str(tmp_path / "tp2"), MODEL, VOCAB)
    one = load_megatron_legacy(str(tmp_path / "tp1"), MODEL, VOCAB)
    assert (two.iteration, two.consumed_samples, two.adam_steps) == (5, 40, 0)
    assert any("moments start at zero" in line for line in two.notes)
    for name, kinds in one.canonical.items():
        assert torch.equal(two.canonical[name]["master"], kinds["master"]), name
    with pytest.raises(JobFormatError, match="model.arch=llama"):
        load_megatron_legacy(str(tmp_path / "tp1"), ModelConfig(name="l", arch="llama"), VOCAB)
    with pytest.raises(JobFormatError, match="mp_rank_"):
        load_megatron_legacy(str(tmp_path), MODEL, VOCAB)
