"""Blends and splits as a user configures them: bad settings are one line naming the field and the fix, and a
training run on a blend of Megatron and MegaTier corpora goes through megatier-train."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megatier.config import ConfigError, validate
from megatier.config.fingerprint import state_fingerprint
from megatier.data.corpus import build_dataset, stdlib_files
from tests.conftest import REPO
from tests.unit.data.megatron_reference import random_documents, write_corpus

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def small_corpora(tmp_path_factory) -> list[str]:
    """Two Megatron corpora of byte-sized tokens (uint16 and int32) and one MegaTier corpus."""
    root = tmp_path_factory.mktemp("blend_corpora")
    rng = np.random.default_rng(3)
    prefixes = []
    for name, dtype in (("web", np.uint16), ("code", np.int32)):
        prefixes.append(str(root / name))
        write_corpus(prefixes[-1], random_documents(rng, 40, 256, max_len=60), dtype)
    prefixes.append(str(root / "own"))
    build_dataset(stdlib_files(400_000), prefixes[-1], tokenizer="byte")
    return prefixes


@pytest.mark.parametrize("overrides,line", [
    (["data.split=1/1/1"], "data.split='1/1/1' cuts the corpora of data.blend; set data.blend (Megatron's "
                           "--data-path) or unset data.split"),
    (["data.blend=[{web}]", "data.prefix={own}"], "data.prefix and data.blend both name the data; keep one "
                                                  "(unset data.prefix)"),
    (["data.blend=[{web}]", "data.train_blend=[{web}]"], "data.blend and data.train_blend both name the data, as "
                                                         "Megatron's --data-path and --train-data-path do; keep one"),
    (["data.valid_blend=[{web}]"], "data.valid_blend without data.train_blend leaves nothing to train on; set "
                                   "data.train_blend too"),
    (["data.blend=[{web}]", "data.split=a/b"], "data.split: 'a/b' must be one to three non-negative weights, not "
                                               "all zero, e.g. 969,30,1"),
    (["data.blend=[0.5,{web},{code},{own}]"], "data.blend: [0.5, '{web}', '{code}', '{own}'] mixes weights and "
                                              "prefixes: give a weight before every prefix, or none"),
    (["data.blend=[1,{web},1,{web}_missing]"], "data.blend: {web}_missing.bin does not exist; name each corpus by "
                                               "its path without .bin or .idx"),
])
def test_a_bad_blend_is_one_line_naming_the_field(compose_config, small_corpora, overrides, line):
    web, code, own = small_corpora
    cfg = compose_config("model=tiny", "model.vocab_size=512",
                         *[o.format(web=web, code=code, own=own) for o in overrides])
    with pytest.raises(ConfigError) as caught:
        validate(cfg)
    assert str(caught.value) == line.format(web=web, code=code, own=own)


def test_a_megatron_corpus_needs_model_vocab_size(compose_config, small_corpora):
    web = small_corpora[0]
    for key in ("data.blend", "data.train_blend"):
        with pytest.raises(ConfigError, match=rf"{key}: {web} is a Megatron corpus, which records no vocabulary; "
                                              "set model.vocab_size"):
            validate(compose_config("model=tiny", f"{key}=[{web}]"))
    with pytest.raises(ConfigError, match="data.prefix: .* is a Megatron corpus"):
        validate(compose_config("model=tiny", f"data.prefix={web}"))
    validate(compose_config("model=tiny", f"data.blend=[{small_corpora[2]}]"))  # MegaTier's records its own


def test_training_on_a_blend_with_a_split_exits_0(tmp_path, small_corpora):
    web, code, own = small_corpora
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "MEGATIER_NODE_NAME", "GROUP_RANK")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", MEGATIER_CACHE=str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    args = ["model=tiny", "model.vocab_size=512", "train.iters=3", f"data.blend=[0.5,{web},0.3,{code},0.2,{own}]",
            "data.split=85/10/5", "data.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=2",
            "train.eval_interval=2", "logging.wandb.mode=disabled", "logging.progress=false",
            f"logging.run_dir={run_dir}", "checkpoint=disabled"]
    proc = subprocess.run([sys.executable, "-m", "megatier.train", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for path, _, files in os.walk(run_dir) for name in files if name == "metrics.jsonl"
               for line in open(os.path.join(path, name)) if line.strip()]
    assert sorted({m["step"] for m in metrics if "loss" in m}) == [1, 2, 3]
    assert any("val_loss" in m for m in metrics)  # validation reads the valid split


def test_data_train_samples_is_checked_and_recorded_only_for_a_blend(compose_config, small_corpora):
    web, code, _ = small_corpora
    blend = f"data.blend=[{web},{code}]"
    common = ("model=tiny", "model.vocab_size=512", "train.global_batch_size=8", "train.micro_batch_size=2",
              "optim.decay_iters=100")
    with pytest.raises(ConfigError, match=r"^data.train_samples sizes a blend's order; set data.blend"):
        validate(compose_config(*common, "data.train_samples=100"))
    with pytest.raises(ConfigError, match=r"^data.train_samples=100 is fewer than the 160 samples train.iters=20 x "
                                          r"train.global_batch_size=8 trains on; raise it to at least 160"):
        validate(compose_config(*common, blend, "train.iters=20", "data.train_samples=100"))

    def fingerprint(*overrides):
        return state_fingerprint(compose_config(*common, *overrides), "checksum")

    # A blend's order is built for its sample count: training longer changes it, unless the job planned for it.
    assert fingerprint(blend, "train.iters=20")["data.train_samples"] == "160"
    assert fingerprint(blend, "train.iters=20") != fingerprint(blend, "train.iters=30")
    planned = ("data.train_samples=400",)
    assert fingerprint(blend, "train.iters=20", *planned) == fingerprint(blend, "train.iters=30", *planned)
    assert "data.train_samples" not in fingerprint("train.iters=20")  # data.prefix: the order is the epochs'
