"""Qwen2-MoE and dense Qwen2 interop: a MegaTier model loaded from transformers' Qwen2MoeForCausalLM (q/k/v
biases, a gated shared expert, softmax-then-top-k routing, a dense layer among the MoE ones) computes its logits;
an export writes back its tensors bitwise; what MegaTier cannot represent is refused by key."""
from __future__ import annotations

import json

import pytest
import torch

from megatier.config import ModelConfig
from megatier.config.schema import MoEConfig
from megatier.interop.hf_files import HFFormatError, read_tensors
from megatier.interop.huggingface import export_hf, hf_kind, load_hf
from megatier.model.gpt import GPTStage, load_full_state
from megatier.model.params import StageSpec
from tests.hf_qwen2_moe import save_random_qwen2, save_random_qwen2_moe

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(120)

VOCAB = 259
QWEN = ModelConfig(name="qwen_t", arch="llama", num_layers=3, hidden_size=64, num_heads=4, num_query_groups=2,
                   ffn_hidden_size=96, max_position_embeddings=64, rope_theta=5000.0, norm_eps=1e-6, qkv_bias=True,
                   moe=MoEConfig(num_experts=6, top_k=3, moe_ffn_hidden_size=32, router_norm="softmax_topk",
                                 shared_expert_hidden_size=80, aux_loss_coeff=0.01, layer_freq=2))
DENSE = ModelConfig(**{**QWEN.__dict__, "name": "qwen2_t", "moe": MoEConfig()})


def _logits(cfg: ModelConfig, state: dict, tokens: torch.Tensor, process_group) -> torch.Tensor:
    model = GPTStage(cfg, VOCAB, StageSpec(range(cfg.num_layers), True, True), tp_group=process_group.tp_group,
                     dropout_generator=torch.Generator())
    load_full_state(model, state)
    with torch.no_grad():
        return model.eval()(tokens)[..., :VOCAB]


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 40), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("cfg,save", [(QWEN, save_random_qwen2_moe), (DENSE, save_random_qwen2)],
                         ids=["qwen2_moe", "qwen2"])
def test_logits_equal_transformers_and_the_export_is_its_tensors_bitwise(process_group, tmp_path, cfg, save):
    theirs = save(str(tmp_path / "hf"), cfg, VOCAB)
    state = load_hf(str(tmp_path / "hf"), cfg, VOCAB)
    tokens = _tokens()
    with torch.no_grad():
        expected = theirs(tokens).logits
    diff = (_logits(cfg, state, tokens, process_group) - expected).abs().max()
    print(f"{hf_kind(cfg)}: max logit difference {diff:.2e}")
    assert diff <= 1e-4, diff
    export_hf(state, cfg, str(tmp_path / "out"))
    original, exported = read_tensors(str(tmp_path / "hf")), read_tensors(str(tmp_path / "out"))
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(again) is type(theirs)
    with torch.no_grad():
        assert torch.equal(again(tokens).logits, expected)


def test_qwen2_moe_config_names_the_routing_and_the_mlp_only_layers(tmp_path):
    export_hf(load_hf(str(_saved(tmp_path)), QWEN, VOCAB), QWEN, str(tmp_path / "out"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2MoeForCausalLM"] and config["qkv_bias"] is True
    assert config["mlp_only_layers"] == [1] and config["decoder_sparse_step"] == 1
    assert config["norm_topk_prob"] is False and config["use_sliding_window"] is False


def _saved(tmp_path):
    path = tmp_path / "hf"
    if not path.exists():
        save_random_qwen2_moe(str(path), QWEN, VOCAB)
    return path


@pytest.mark.parametrize("override,named", [
    ({"use_sliding_window": True}, "use_sliding_window=True"),
    ({"mlp_only_layers": [0]}, "mlp_only_layers=[0]"),
    ({"decoder_sparse_step": 2, "mlp_only_layers": []}, "decoder_sparse_step=2"),
    ({"mlp_only_layers": [1, 2]}, "model.moe.layer_freq=3"),
    ({"norm_topk_prob": True}, "model.moe.router_renormalize=true"),
    ({"num_experts": 8}, "model.moe.num_experts=8"),
    ({"qkv_bias": False}, "model.qkv_bias=false"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
])
def test_what_megatier_cannot_represent_is_refused_naming_the_key(tmp_path, override, named):
    config_path = _saved(tmp_path) / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **override}))
    with pytest.raises(HFFormatError, match=named.replace("[", r"\[")) as err:
        load_hf(str(tmp_path / "hf"), QWEN, VOCAB)
    assert "\n" not in str(err.value)


def test_a_model_without_q_k_v_biases_is_not_loaded_into_qkv_bias(tmp_path):
    from tests.hf_mixtral import save_random_mixtral

    mixtral = ModelConfig(**{**QWEN.__dict__, "qkv_bias": False,
                             "moe": MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=32)})
    save_random_mixtral(str(tmp_path / "hf"), mixtral, VOCAB)
    assert hf_kind(mixtral) == "mixtral" and hf_kind(QWEN) == "qwen2_moe" and hf_kind(DENSE) == "qwen2"
    with pytest.raises(HFFormatError, match="model.qkv_bias=false"):
        load_hf(str(tmp_path / "hf"), ModelConfig(**{**mixtral.__dict__, "qkv_bias": True}), VOCAB)


def test_a_directory_of_the_other_kind_is_refused_in_one_line(tmp_path):
    from tests.hf_llama import save_random_llama

    save_random_llama(str(tmp_path / "llama"), DENSE, VOCAB)
    with pytest.raises(HFFormatError, match="model_type='llama', not 'qwen2_moe'") as err:
        load_hf(str(tmp_path / "llama"), QWEN, VOCAB)  # a MoE model does not read a dense directory
    assert "\n" not in str(err.value)
    save_random_qwen2(str(tmp_path / "qwen2"), DENSE, VOCAB)
    with pytest.raises(HFFormatError, match="qkv_bias=True; set model.qkv_bias=true"):
        load_hf(str(tmp_path / "qwen2"), ModelConfig(**{**DENSE.__dict__, "qkv_bias": False}), VOCAB)


def test_qwen2_moe_refuses_a_model_without_a_shared_expert_naming_the_key():
    from megatier.interop.qwen2_moe import check_representable

    no_shared = ModelConfig(**{**QWEN.__dict__, "moe": MoEConfig(num_experts=6, top_k=3, router_norm="softmax_topk")})
    with pytest.raises(HFFormatError, match="model.moe.shared_expert_hidden_size=0"):
        check_representable(no_shared)


def test_the_qwen_moe_preset_is_qwen1_5_moe_a2_7b_tensor_by_tensor(compose_config):
    """Qwen2MoeConfig's defaults are Qwen1.5-MoE-A2.7B's; built on the meta device, its checkpoint tensors are
    the preset's canonical ones through the name map, shape by shape."""
    from megatier.config import validate
    from megatier.interop.qwen2_moe import qwen2_name_map
    from megatier.model.params import canonical_shapes

    cfg = compose_config("model=qwen_moe_a2_7b")
    validate(cfg)
    m = cfg.model
    with torch.device("meta"):
        theirs = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig())
    hf_shapes = {name: tuple(p.shape) for name, p in theirs.state_dict().items()}
    hf_shapes.update(_per_expert_shapes(hf_shapes, m.moe.num_experts))
    pairs = qwen2_name_map(m)
    assert {name for _, names in pairs for name in names} == hf_shapes.keys()
    ours = canonical_shapes(m, m.vocab_size)
    assert ours.keys() == {name for name, _ in pairs}
    for name, names in pairs:
        shapes = [hf_shapes[n] for n in names]
        assert ours[name] == (sum(s[0] for s in shapes), *shapes[0][1:]), name


def _per_expert_shapes(hf_shapes: dict, num_experts: int) -> dict:
    """transformers' fused experts (gate_up_proj (E, 2f, h), down_proj (E, h, f)) as the checkpoint's per-expert
    tensors; the fused names taken out of ``hf_shapes``."""
    out = {}
    for fused in [n for n in hf_shapes if n.endswith("mlp.experts.gate_up_proj") or n.endswith("experts.down_proj")]:
        shape, prefix = hf_shapes.pop(fused), fused.rsplit(".", 1)[0]
        for e in range(num_experts):
            if fused.endswith("gate_up_proj"):
                out[f"{prefix}.{e}.gate_proj.weight"] = out[f"{prefix}.{e}.up_proj.weight"] = (shape[1] // 2, shape[2])
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = shape[1:]
    return out


def test_a_trained_qwen_like_job_exports_a_qwen2_moe_transformers_computes(tiny_config, tmp_path, capsys):
    """q/k/v biases, a shared expert, Qwen's routing and a dense layer, trained with checkpoints: megatier-convert
    export rebuilds the model from the job's fingerprint and writes a Qwen2MoeForCausalLM with its logits."""
    from megatier.cli import convert
    from megatier.training.trainer import Trainer

    cfg = tiny_config("model=tiny_moe", "model.num_layers=3", "model.qkv_bias=true", "model.moe.layer_freq=2",
                      "model.moe.router_norm=softmax_topk", "model.moe.shared_expert_hidden_size=64",
                      "checkpoint=tiered", "checkpoint.tiers=[local]", "train.iters=4",
                      f"checkpoint.local.root={tmp_path}/shm", "checkpoint.job_id=qwenjob")
    trainer = Trainer(cfg)
    trainer.train()
    trainer.close()
    assert convert.main(["export", "--job-id", "qwenjob", "--local-root", f"{tmp_path}/shm", "--tier", "tier1",
                         str(tmp_path / "hf")]) == 0
    theirs = transformers.Qwen2MoeForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert theirs.config.mlp_only_layers == [1] and theirs.config.qkv_bias
    assert theirs.model.layers[0].self_attn.k_proj.bias.abs().max() > 0  # trained off its zero init
    vocab = theirs.config.vocab_size
    tokens = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (trainer.model.eval()(tokens)[..., :vocab] - theirs(tokens).logits).abs().max() <= 1e-4
