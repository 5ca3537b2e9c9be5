"""An unknown key spelled as Megatron-LM, Hugging Face or nanoGPT name the setting gets that setting's key."""
from __future__ import annotations

import subprocess

import pytest

from megatier.config.keys import ALIASES, all_keys, closest
from tests.conftest import REPO


@pytest.mark.timeout(60)
def test_optim_learning_rate_is_pointed_at_optim_lr_by_the_training_command():
    proc = subprocess.run([str(REPO / ".venv" / "bin" / "megatier-train"), "model=tiny", "optim.learning_rate=1e-3"],
                          capture_output=True, text=True, cwd=REPO, timeout=50)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == ("config error: unknown config key optim.learning_rate (in the override "
                                   "'optim.learning_rate=1e-3'); did you mean optim.lr?")


@pytest.mark.parametrize("key,meant", [("train.learning_rate", "optim.lr"), ("model.n_head", "model.num_heads"),
                                       ("parallel.tensor_model_parallel_size", "parallel.tp"),
                                       ("train.train_iters", "train.iters"), ("optim.max_grad_norm", "optim.clip_grad"),
                                       ("optim.lr_rate", "optim.lr")])  # not an alias: the closest spelling
def test_an_alias_names_its_field_in_any_group(key, meant):
    assert closest(key) == meant


def test_every_alias_names_a_field_of_the_schema():
    names = {k.rsplit(".", 1)[-1] for k in all_keys()}
    assert {a: t for a, t in ALIASES.items() if t not in names} == {}
