"""model.init_from: a single-process trainer starts from a Hugging Face GPT-2 directory."""
from __future__ import annotations

import logging

import pytest
import torch

from megatier.config import ConfigError
from megatier.interop.hf_files import HFFormatError
from megatier.training.trainer import Trainer
from tests.hf_gpt2 import expected_state, hf_loss, save_random_gpt2

pytest.importorskip("transformers")

VOCAB = 257  # the byte corpus of the tiny_config


def test_trainer_starts_from_the_hf_weights(tiny_config, tmp_path, caplog):
    caplog.set_level(logging.INFO)
    cfg = tiny_config("train.iters=1", f"model.init_from={tmp_path / 'hf'}")
    hf = save_random_gpt2(str(tmp_path / "hf"), cfg.model, VOCAB)
    trainer = Trainer(cfg)
    assert f"initialised the tiny model from the Hugging Face GPT-2 at {tmp_path / 'hf'}" in caplog.text
    params = dict(trainer.model.named_parameters())
    for name, value in expected_state(hf, cfg.model.num_layers).items():
        param = params[name][:VOCAB] if name == "word.weight" else params[name]
        assert torch.equal(param, value), name
    assert not params["word.weight"][VOCAB:].any()

    opt = trainer.optimizer  # the fp32 master is the loaded weights; the moments start at zero
    for s in opt.shard_segments:
        flat = params[s.name].detach().flatten()[s.param_offset:s.param_offset + s.numel]
        assert torch.equal(opt.master[s.shard_offset:s.shard_offset + s.numel], flat), s.name
    assert not opt.exp_avg.any() and not opt.exp_avg_sq.any()

    expected = hf_loss(hf, trainer.batches.train_microbatches(1))
    loss = trainer.train_step(1)["loss"]
    trainer.step = 1
    trainer.close()
    assert loss == pytest.approx(expected, rel=0, abs=1e-4)


def test_init_from_a_missing_directory_is_a_config_error(tiny_config, tmp_path):
    cfg = tiny_config(f"model.init_from={tmp_path / 'nowhere'}")
    with pytest.raises(ConfigError, match=r"model.init_from=.*config.json does not exist") as err:
        Trainer(cfg)
    assert "\n" not in str(err.value) and not (tmp_path / "run").exists()


def test_init_from_another_shape_is_refused(tiny_config, tmp_path):
    cfg = tiny_config(f"model.init_from={tmp_path / 'hf'}")
    save_random_gpt2(str(tmp_path / "hf"), cfg.model, 300)
    fix = r"vocab_size=300 but the model has model.vocab_size=257; set model.vocab_size=300"
    with pytest.raises(HFFormatError, match=fix):  # megatier-train: "config error: model.init_from: ...", exit 2
        Trainer(cfg)
