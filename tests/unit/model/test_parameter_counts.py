"""The parameter counts the model presets' comments and docs/configuration.md state are the model's, as the
size planner (megatier-inspect --plan) prints them, with the byte tokenizer's 257 tokens."""
from __future__ import annotations

import re
import subprocess

import pytest

from megatier.config import compose_config
from megatier.model.params import count_parameters
from tests.conftest import REPO

BYTE_VOCAB = 257
STATED = re.compile(r"~(\d+\.\d+)M parameters with the byte tokenizer")
PRESETS = sorted(p.stem for p in (REPO / "configs" / "model").glob("*.yaml") if STATED.search(p.read_text()))


def _millions(preset: str, decimals: int) -> str:
    return f"{count_parameters(compose_config([f'model={preset}']).model, BYTE_VOCAB) / 1e6:.{decimals}f}"


@pytest.mark.parametrize("preset", PRESETS)
def test_a_preset_states_its_parameter_count(preset):
    stated = STATED.search((REPO / "configs" / "model" / f"{preset}.yaml").read_text()).group(1)
    assert stated == _millions(preset, len(stated.split(".")[1]))


def test_the_configuration_page_states_each_presets_count():
    table = (REPO / "docs" / "configuration.md").read_text()
    stated = dict(re.findall(r"`(\w+)` \((?:\w+, )?(\d+\.\d+)M(?: parameters)?\)", table))
    assert {"tiny", "small", "llama_tiny", "llama_small"} <= set(stated), stated
    for preset, figure in stated.items():
        assert figure == _millions(preset, len(figure.split(".")[1])), preset


@pytest.mark.timeout(60)
def test_the_size_plan_prints_two_figures_for_a_model_under_a_million():
    proc = subprocess.run([str(REPO / ".venv" / "bin" / "megatier-inspect"), "--plan", "--", "model=tiny"],
                          capture_output=True, text=True, cwd=REPO, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"size plan: model tiny ({_millions('tiny', 2)}M parameters, vocabulary 257")
