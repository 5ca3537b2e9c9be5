"""model.moe against transformers' MixtralForCausalLM on the same weights (tp=1; tp=2 with sequence parallelism in
tests/distributed/model/test_moe_tp.py): logits, the load-balancing loss in the objective, the Mixtral round
trip and its refusals; Qwen2-MoE's routing and gated shared expert; dropless routing, the z-loss, the step's
router figures and full recomputation."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from megatier.config import ModelConfig
from megatier.config.schema import MoEConfig
from megatier.interop.hf_files import HFFormatError
from megatier.interop.huggingface import export_hf, load_hf
from megatier.model.gpt import GPTStage, init_weights, load_full_state
from megatier.model.moe import moe_layers, router_losses
from megatier.model.params import StageSpec, canonical_shapes, stage_parameters
from tests.hf_mixtral import save_random_mixtral

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(120)

VOCAB = 259
CFG = ModelConfig(name="moe_t", arch="llama", num_layers=2, hidden_size=64, num_heads=4, num_query_groups=2,
                  ffn_hidden_size=96, max_position_embeddings=64, rope_theta=5000.0, norm_eps=1e-6,
                  moe=MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=48, aux_loss_coeff=0.02))


def _stage(process_group, cfg: ModelConfig = CFG) -> GPTStage:
    return GPTStage(cfg, VOCAB, StageSpec(range(cfg.num_layers), True, True), tp_group=process_group.tp_group,
                    dropout_generator=torch.Generator())


def _tokens(b: int = 3, s: int = 48, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


def test_logits_equal_hugging_face_mixtral(process_group, tmp_path):
    theirs = save_random_mixtral(str(tmp_path / "hf"), CFG, VOCAB)
    ours = _stage(process_group)
    load_full_state(ours, load_hf(str(tmp_path / "hf"), CFG, VOCAB))
    tokens = _tokens()
    with torch.no_grad():
        diff = (ours.eval()(tokens)[..., :VOCAB] - theirs(tokens).logits).abs().max()
    print(f"max logit difference {diff:.2e}")
    assert diff <= 1e-4, diff


def test_training_loss_is_cross_entropy_plus_mixtral_aux_loss(process_group, tmp_path):
    theirs = save_random_mixtral(str(tmp_path / "hf"), CFG, VOCAB).train()
    ours = _stage(process_group).train()
    load_full_state(ours, load_hf(str(tmp_path / "hf"), CFG, VOCAB))
    tokens, labels = _tokens(), _tokens(seed=2)
    out = theirs(tokens, output_router_logits=True)
    want = F.cross_entropy(out.logits.flatten(0, 1), labels.flatten()) + CFG.moe.aux_loss_coeff * out.aux_loss
    got = ours(tokens, labels).mean().detach()
    got, want = got.item(), want.item()
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    aux, _ = router_losses(moe_layers(ours.layers), CFG, process_group.tp_group, False)
    assert abs(aux.item() - out.aux_loss.item()) <= 1e-6, (aux.item(), out.aux_loss.item())


def test_dropless_every_slot_reaches_an_expert_and_every_expert_gets_a_gradient(process_group):
    cfg = ModelConfig(**{**CFG.__dict__, "moe": MoEConfig(num_experts=8, top_k=2, moe_ffn_hidden_size=48)})
    model = _stage(process_group, cfg).train()
    init_weights(model, seed=3)
    tokens = _tokens(b=1, s=4)  # 8 slots over 8 experts: some get none
    model(tokens, _tokens(b=1, s=4, seed=2)).mean().backward()
    stats = [layer.route_stats for layer in moe_layers(model.layers)]
    assert all(int(st.slots_per_expert.sum()) == 4 * 2 for st in stats)
    assert any(int(st.slots_per_expert.min()) == 0 for st in stats)
    assert all(p.grad is not None for p in model.parameters())


def test_z_loss_is_the_mean_squared_logsumexp_of_the_router_logits(process_group):
    cfg = ModelConfig(**{**CFG.__dict__, "moe": MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=48,
                                                          z_loss_coeff=1e-3)})
    model = _stage(process_group, cfg).train()
    init_weights(model, seed=4)
    tokens = _tokens(b=2, s=16)
    captured = []
    for layer in moe_layers(model.layers):
        layer.router.register_forward_hook(lambda m, args, out: captured.append(F.linear(args[0], m.weight)))
    model(tokens, _tokens(b=2, s=16, seed=2))
    _, z = router_losses(moe_layers(model.layers), cfg, process_group.tp_group, False)
    want = torch.cat(captured).logsumexp(-1).square().mean()
    assert torch.allclose(z, want, rtol=1e-6), (z, want)


def test_shared_expert_and_layer_freq_build_their_canonical_parameters(process_group):
    cfg = ModelConfig(**{**CFG.__dict__, "moe": MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=48,
                                                          shared_expert_hidden_size=32, layer_freq=2,
                                                          router_norm="softmax_topk")})
    model = _stage(process_group, cfg)
    spec = StageSpec(range(cfg.num_layers), True, True)
    described = [(p.name, p.shape) for p in stage_parameters(cfg, VOCAB, spec)]
    assert described == [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert "layers.0.moe.shared_gate.weight" in dict(described) and "layers.1.mlp.proj.weight" in dict(described)
    init_weights(model, seed=5)
    assert model(_tokens(b=2, s=16)).shape == (2, 16, 384)


def test_export_then_import_is_bitwise_and_loads_in_transformers(tmp_path):
    gen = torch.Generator().manual_seed(3)
    state = {name: torch.randn(shape, generator=gen) for name, shape in canonical_shapes(CFG, VOCAB).items()}
    export_hf(state, CFG, str(tmp_path / "out"), tokenizer={"type": "byte"})
    again = load_hf(str(tmp_path / "out"), CFG, VOCAB)
    assert again.keys() == state.keys() and all(torch.equal(again[k], state[k]) for k in state)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["model_type"] == "mixtral" and config["num_local_experts"] == 4
    model = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(model.model.layers[1].mlp.gate.weight, state["layers.1.moe.router.weight"])


@pytest.mark.parametrize("override,named", [
    ({"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ({"sliding_window": 16}, "sliding_window"),
    ({"num_local_experts": 8}, "model.moe.num_experts=8"),
])
def test_a_mixtral_megatier_cannot_represent_is_refused_naming_the_key(tmp_path, override, named):
    save_random_mixtral(str(tmp_path / "hf"), CFG, VOCAB)
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **override}))
    with pytest.raises(HFFormatError, match=named) as err:
        load_hf(str(tmp_path / "hf"), CFG, VOCAB)
    assert "\n" not in str(err.value)


def test_step_metrics_report_the_router_figures_once(process_group):
    model = _stage(process_group).train()
    init_weights(model, seed=6)
    for seed in (1, 2):  # two micro-batches of 2 x 16 tokens: 64 top-k slots per MoE layer over 4 experts
        model(_tokens(b=2, s=16, seed=seed), _tokens(b=2, s=16, seed=seed + 10))
    figures = model.step_metrics()
    assert figures["moe_dropped_tokens"] == 0 and figures["moe_aux_loss"] > 0
    assert figures["moe_tokens_per_expert_min"] <= 16 <= figures["moe_tokens_per_expert_max"]
    assert model.step_metrics() == {}
    dense = ModelConfig(**{**CFG.__dict__, "moe": MoEConfig()})
    assert _stage(process_group, dense).train().step_metrics() == {}


def test_full_recomputation_gives_the_gradients_of_none(process_group):
    """The router statistics leave a recomputed block: the router losses' gradients still reach the router."""
    grads = {}
    for recompute in ("none", "full"):
        model = _stage(process_group, ModelConfig(**{**CFG.__dict__, "recompute": recompute})).train()
        init_weights(model, seed=7)
        model(_tokens(b=2, s=16), _tokens(b=2, s=16, seed=2)).mean().backward()
        grads[recompute] = {n: p.grad for n, p in model.named_parameters()}
    for name, grad in grads["none"].items():
        assert torch.equal(grads["full"][name], grad), name


def _qwen2_moe_state(theirs, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The canonical state of a transformers Qwen2MoeForCausalLM (its modules' tensors, fused experts in memory)."""
    hf = {n: p.detach() for n, p in theirs.named_parameters()}
    state = {"word.weight": hf["model.embed_tokens.weight"], "final_norm.weight": hf["model.norm.weight"],
             "head_weight": hf["lm_head.weight"]}
    for i in range(cfg.num_layers):
        t, o = f"model.layers.{i}.", f"layers.{i}."
        kv = torch.cat([hf[t + "self_attn.k_proj.weight"], hf[t + "self_attn.v_proj.weight"]])
        state.update({o + "ln1.weight": hf[t + "input_layernorm.weight"],
                      o + "attn.q.weight": hf[t + "self_attn.q_proj.weight"], o + "attn.kv.weight": kv,
                      o + "attn.proj.weight": hf[t + "self_attn.o_proj.weight"],
                      o + "ln2.weight": hf[t + "post_attention_layernorm.weight"],
                      o + "moe.router.weight": hf[t + "mlp.gate.weight"],
                      o + "moe.shared.gate_up.weight": torch.cat([hf[t + "mlp.shared_expert.gate_proj.weight"],
                                                                  hf[t + "mlp.shared_expert.up_proj.weight"]]),
                      o + "moe.shared.proj.weight": hf[t + "mlp.shared_expert.down_proj.weight"],
                      o + "moe.shared_gate.weight": hf[t + "mlp.shared_expert_gate.weight"]})
        for e in range(cfg.moe.num_experts):
            state[f"{o}moe.experts.{e}.gate_up.weight"] = hf[t + "mlp.experts.gate_up_proj"][e]
            state[f"{o}moe.experts.{e}.proj.weight"] = hf[t + "mlp.experts.down_proj"][e]
    return state


def test_shared_expert_and_softmax_topk_equal_hugging_face_qwen2_moe(process_group):
    cfg = ModelConfig(**{**CFG.__dict__, "moe": MoEConfig(num_experts=6, top_k=3, moe_ffn_hidden_size=32,
                                                          router_norm="softmax_topk", shared_expert_hidden_size=80,
                                                          aux_loss_coeff=0.01)})
    config = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        shared_expert_intermediate_size=80, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=6, num_experts_per_tok=3, norm_topk_prob=False, qkv_bias=False, tie_word_embeddings=False,
        max_position_embeddings=64, rope_theta=5000.0, rms_norm_eps=1e-6, router_aux_loss_coef=0.01)
    torch.manual_seed(0)
    theirs = transformers.Qwen2MoeForCausalLM(config).train()
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    ours = _stage(process_group, cfg).train()
    load_full_state(ours, _qwen2_moe_state(theirs, cfg))
    tokens, labels = _tokens(), _tokens(seed=2)
    out = theirs(tokens, output_router_logits=True)
    want = (F.cross_entropy(out.logits.flatten(0, 1), labels.flatten()) + 0.01 * out.aux_loss).item()
    got = ours(tokens, labels).mean().item()
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    with torch.no_grad():
        assert (ours.eval()(tokens)[..., :VOCAB] - theirs.eval()(tokens).logits).abs().max() <= 1e-4


def test_per_layer_router_losses_equal_megatron_cores(process_group):
    """router_loss_scope=layer: each MoE layer's switch load-balancing loss (with Megatron's 1/top_k) and z-loss,
    summed over the layers, as megatron-core's switch_load_balancing_loss_func and z_loss_func compute them."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    cfg = ModelConfig(**{**CFG.__dict__, "moe": MoEConfig(num_experts=4, top_k=2, moe_ffn_hidden_size=48,
                                                          router_loss_scope="layer")})
    model = _stage(process_group, cfg).train()
    init_weights(model, seed=5)
    inputs = []
    for layer in moe_layers(model.layers):
        layer.router.register_forward_hook(lambda mod, args, out: inputs.append((mod, args[0].detach())))
    model(_tokens(), _tokens(seed=2))
    aux, z = router_losses(moe_layers(model.layers), cfg, process_group.tp_group, False)
    want_aux = want_z = 0.0
    for router, tokens in inputs:
        logits = F.linear(tokens, router.weight.detach())
        probs = torch.softmax(logits, dim=-1)
        per_expert = torch.bincount(torch.topk(probs, 2, dim=-1).indices.flatten(), minlength=4).float()
        want_aux += moe_utils.switch_load_balancing_loss_func(probs, per_expert, tokens.shape[0], 2, 4, 1.0).item()
        want_z += moe_utils.z_loss_func(logits, 1.0).item()
    assert len(inputs) == 2 and abs(want_aux - 2.0) < 0.5  # about 1 per layer for a near-balanced router
    assert aux.item() == pytest.approx(want_aux, rel=1e-6) and z.item() == pytest.approx(want_z, rel=1e-6)
