"""A blend of Megatron-format and MegaTier corpora for the data tests that run whole jobs."""
from __future__ import annotations

import numpy as np
import pytest

from megatier.data.corpus import build_dataset, stdlib_files
from tests.unit.data.megatron_reference import random_documents, write_corpus


@pytest.fixture(scope="session")
def blend(tmp_path_factory) -> list[str]:
    """Three corpora by weight, two in Megatron's format (uint16 and int32 tokens) and one in MegaTier's, split
    as Megatron's --split; sized for 30 steps, so a relaunch may train ten steps longer in the same order."""
    root, rng = tmp_path_factory.mktemp("exactly_once_corpora"), np.random.default_rng(5)
    for name, dtype in (("web", np.uint16), ("code", np.int32)):
        write_corpus(str(root / name), random_documents(rng, 60, 256, max_len=80), dtype)
    build_dataset(stdlib_files(200_000), str(root / "own"), tokenizer="byte")
    return [f"data.blend=[0.5,{root}/web,0.3,{root}/code,0.2,{root}/own]", "data.split=90/8/2",
            "model.vocab_size=512", "data.train_samples=240"]
