"""Hugging Face GPT-2 export and import against transformers' own GPT2LMHeadModel (built locally)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from megatier.config import ModelConfig
from megatier.data.tokenizer import train_bpe
from megatier.interop.gpt2 import export_gpt2, load_gpt2
from megatier.interop.hf_files import HFFormatError
from megatier.model.gpt import GPTStage, load_full_state
from megatier.model.params import StageSpec, canonical_shapes
from tests.hf_gpt2 import save_random_gpt2

transformers = pytest.importorskip("transformers")

VOCAB = 259
CFG = ModelConfig(num_layers=2, hidden_size=32, num_heads=4, ffn_hidden_size=96, max_position_embeddings=32)


def _random_state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) * 0.3 for n, s in canonical_shapes(CFG, VOCAB).items()}


def _megatier(process_group, state: dict[str, torch.Tensor]) -> GPTStage:
    model = GPTStage(CFG, VOCAB, StageSpec(range(CFG.num_layers), True, True), tp_group=process_group.tp_group,
                     dropout_generator=torch.Generator())
    load_full_state(model, state)
    return model.eval()


def _from_pretrained(path):
    model, info = transformers.GPT2LMHeadModel.from_pretrained(path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def _greedy(next_logits, prompt: torch.Tensor, n: int) -> torch.Tensor:
    tokens = prompt
    for _ in range(n):
        tokens = torch.cat([tokens, next_logits(tokens).argmax(-1, keepdim=True)], dim=1)
    return tokens[:, prompt.shape[1]:]


@torch.no_grad()
def test_export_computes_megatiers_function_in_transformers(process_group, tmp_path):
    state = _random_state()
    ours = _megatier(process_group, state)
    export_gpt2(state, CFG, str(tmp_path / "hf"), tokenizer={"type": "byte"})
    theirs = _from_pretrained(tmp_path / "hf")
    assert theirs.config.vocab_size == VOCAB and theirs.config.eos_token_id == 256
    assert os.stat(tmp_path / "hf" / "model.safetensors").st_mode & 0o777 == 0o644  # readable, as config.json

    tokens = torch.randint(0, VOCAB, (3, CFG.max_position_embeddings), generator=torch.Generator().manual_seed(1))
    expected = ours(tokens)[..., :VOCAB]
    torch.testing.assert_close(theirs(tokens).logits, expected, rtol=0.0, atol=1e-4)

    prompt = tokens[:, :8]
    ours_greedy = _greedy(lambda t: ours(t)[:, -1, :VOCAB], prompt, 20)
    theirs_greedy = _greedy(lambda t: theirs(t).logits[:, -1], prompt, 20)
    assert torch.equal(ours_greedy, theirs_greedy)


def test_import_then_export_is_bitwise_the_imported_weights(tmp_path):
    save_random_gpt2(str(tmp_path / "src"), CFG, VOCAB)
    state = load_gpt2(str(tmp_path / "src"), CFG, VOCAB)
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in state.values())
    export_gpt2(state, CFG, str(tmp_path / "out"))
    before, after = load_file(tmp_path / "src" / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert before.keys() == after.keys()
    for name, value in before.items():
        assert torch.equal(after[name], value), name
    with open(tmp_path / "out" / "config.json") as f:
        assert json.load(f)["model_type"] == "gpt2"


def test_export_writes_the_bpe_tokenizer(tmp_path):
    tok = train_bpe(iter(["def hello(world):\n    return world + 1\n"] * 50), 300, str(tmp_path / "tok.json"))
    state = {n: torch.zeros(s) for n, s in canonical_shapes(CFG, tok.vocab_size).items()}
    export_gpt2(state, CFG, str(tmp_path / "hf"), tokenizer=tok.spec())
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "def hello(x):\n  return x<|endoftext|>"
    assert theirs.encode(text) == tok.encode(text) and theirs.eos_token_id == tok.eod_id


def _one_line_error(call, match: str) -> str:
    with pytest.raises(HFFormatError, match=match) as err:
        call()
    assert "\n" not in str(err.value)
    return str(err.value)


def test_bad_directories_get_one_clear_line(tmp_path):
    _one_line_error(lambda: load_gpt2(str(tmp_path / "nowhere"), CFG, VOCAB), "is not a directory")
    (tmp_path / "empty").mkdir()
    _one_line_error(lambda: load_gpt2(str(tmp_path / "empty"), CFG, VOCAB), "has no config.json")
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    _one_line_error(lambda: load_gpt2(str(tmp_path / "bert"), CFG, VOCAB), "model_type='bert', not 'gpt2'")
    save_random_gpt2(str(tmp_path / "noweights"), CFG, VOCAB)
    os.remove(tmp_path / "noweights" / "model.safetensors")
    _one_line_error(lambda: load_gpt2(str(tmp_path / "noweights"), CFG, VOCAB), "has no model.safetensors")


def test_another_shape_names_both_and_the_fix(tmp_path):
    save_random_gpt2(str(tmp_path / "hf"), CFG, VOCAB)
    deeper = ModelConfig(**{**CFG.__dict__, "num_layers": 3, "num_heads": 2})
    message = _one_line_error(lambda: load_gpt2(str(tmp_path / "hf"), deeper, VOCAB), "holds a GPT-2 with")
    assert "n_layer=2, n_head=4" in message and "model.num_layers=3, model.num_heads=2" in message
    assert "set model.num_layers=2 model.num_heads=4" in message
    message = _one_line_error(lambda: load_gpt2(str(tmp_path / "hf"), CFG, 257), "vocab_size=259")
    assert "model.vocab_size=257" in message


def test_another_function_is_refused(tmp_path):
    save_random_gpt2(str(tmp_path / "relu"), CFG, VOCAB, activation_function="relu")
    _one_line_error(lambda: load_gpt2(str(tmp_path / "relu"), CFG, VOCAB), "activation_function='relu'")


def test_export_refuses_a_state_of_another_shape_and_a_used_directory(tmp_path):
    state = _random_state()
    state["layers.1.mlp.fc.weight"] = torch.zeros(128, 32)
    _one_line_error(lambda: export_gpt2(state, CFG, str(tmp_path / "a")), r"has shape \(128, 32\)")
    assert not (tmp_path / "a").exists()
    del state["layers.1.mlp.fc.weight"]
    _one_line_error(lambda: export_gpt2(state, CFG, str(tmp_path / "a")), "missing")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    _one_line_error(lambda: export_gpt2(_random_state(), CFG, str(tmp_path / "used")), "is not empty")
