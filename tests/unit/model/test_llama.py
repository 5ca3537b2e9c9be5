"""model.arch=llama against transformers.LlamaForCausalLM on the same weights (tp=1 here; tp=2 and sequence
parallelism in tests/distributed/model/test_llama_tp.py), and the Hugging Face Llama round trip."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from megatier.config import ModelConfig
from megatier.interop.hf_files import HFFormatError
from megatier.interop.llama import export_llama, load_llama
from megatier.model.gpt import GPTStage, load_full_state
from megatier.model.params import StageSpec, canonical_shapes
from tests.hf_llama import greedy, save_random_llama

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(120)

VOCAB = 259
CFG = ModelConfig(name="llama_t", arch="llama", num_layers=2, hidden_size=64, num_heads=4, num_query_groups=2,
                  ffn_hidden_size=96, max_position_embeddings=64, rope_theta=5000.0, norm_eps=1e-6)


def _ours(process_group, state) -> GPTStage:
    model = GPTStage(CFG, VOCAB, StageSpec(range(CFG.num_layers), True, True), tp_group=process_group.tp_group,
                     dropout_generator=torch.Generator())
    load_full_state(model, state)
    return model.eval()


def test_logits_and_greedy_tokens_equal_hugging_face_llama(process_group, tmp_path):
    theirs = save_random_llama(str(tmp_path / "hf"), CFG, VOCAB)
    ours = _ours(process_group, load_llama(str(tmp_path / "hf"), CFG, VOCAB))
    tokens = torch.randint(0, VOCAB, (3, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(tokens).logits
        got = ours(tokens)[..., :VOCAB]
    assert (got - expected).abs().max() <= 1e-4, (got - expected).abs().max()
    prompt = tokens[:, :8]
    with torch.no_grad():
        assert torch.equal(greedy(lambda t: ours(t)[:, -1, :VOCAB], prompt),
                           greedy(lambda t: theirs(t).logits[:, -1], prompt))


def test_export_then_import_is_bitwise_and_loads_in_transformers(tmp_path):
    gen = torch.Generator().manual_seed(3)
    state = {name: torch.randn(shape, generator=gen) for name, shape in canonical_shapes(CFG, VOCAB).items()}
    export_llama(state, CFG, str(tmp_path / "out"), tokenizer={"type": "byte"})
    again = load_llama(str(tmp_path / "out"), CFG, VOCAB)
    assert again.keys() == state.keys() and all(torch.equal(again[k], state[k]) for k in state)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_key_value_heads"] == 2 and config["eos_token_id"] == 256 and not config["tie_word_embeddings"]
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    hf = load_file(tmp_path / "out" / "model.safetensors")
    k, v = hf["model.layers.1.self_attn.k_proj.weight"], hf["model.layers.1.self_attn.v_proj.weight"]
    assert torch.equal(torch.cat([k, v]), state["layers.1.attn.kv.weight"])
    assert torch.equal(model.lm_head.weight, state["head_weight"])


@pytest.mark.parametrize("override,named", [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"attention_bias": True}, "attention_bias"),
    ({"num_key_value_heads": 4}, "num_key_value_heads=4"),
])
def test_a_llama_megatier_cannot_represent_is_refused_naming_the_key(tmp_path, override, named):
    save_random_llama(str(tmp_path / "hf"), CFG, VOCAB)
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, **override}))
    with pytest.raises(HFFormatError, match=named) as err:
        load_llama(str(tmp_path / "hf"), CFG, VOCAB)
    assert "\n" not in str(err.value)
