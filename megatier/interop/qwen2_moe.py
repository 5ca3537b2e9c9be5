"""Exchange weights with Hugging Face Qwen2-MoE (``transformers.Qwen2MoeForCausalLM``) for ``model.arch=llama``
with ``model.moe`` and a shared expert, and with dense Qwen2 (``Qwen2ForCausalLM``) for ``model.qkv_bias``
without experts.

Norms, embedding, head, the attention weights and a dense layer's MLP map as Llama's
(:mod:`megatier.interop.llama`); per layer i, Qwen's attention biases and, on a MoE layer, expert e::

    layers.i.attn.q.bias                  model.layers.i.self_attn.q_proj.bias
    layers.i.attn.kv.bias                 model.layers.i.self_attn.k_proj.bias and v_proj.bias, stacked (k first)
    layers.i.moe.router.weight            model.layers.i.mlp.gate.weight
    layers.i.moe.experts.e.gate_up.weight model.layers.i.mlp.experts.e.gate_proj.weight and up_proj.weight, stacked
    layers.i.moe.experts.e.proj.weight    model.layers.i.mlp.experts.e.down_proj.weight
    layers.i.moe.shared.gate_up.weight    model.layers.i.mlp.shared_expert.gate_proj.weight and up_proj.weight
    layers.i.moe.shared.proj.weight       model.layers.i.mlp.shared_expert.down_proj.weight
    layers.i.moe.shared_gate.weight       model.layers.i.mlp.shared_expert_gate.weight

Routing: Qwen's ``norm_topk_prob`` is MegaTier's renormalized top-k (``router_norm=topk_softmax``, or
``softmax_topk`` with ``router_renormalize``); without it, ``softmax_topk`` as it is. Which layers are MoE:
Qwen's are those i with (i + 1) % decoder_sparse_step == 0 not in mlp_only_layers, MegaTier's those with
i % model.moe.layer_freq == 0; an export writes decoder_sparse_step=1 and the dense layers as mlp_only_layers,
and loading accepts any pair of keys that selects MegaTier's layers. Loading refuses, naming the key, a sliding
window, a layer pattern no layer_freq gives, and Llama's list (rope scaling, tied embeddings, ...).
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from megatier.config import ModelConfig
from megatier.config.schema import expert_ffn_size, ffn_size, is_moe_layer
from megatier.interop.hf_files import HFFormatError, read_config
from megatier.interop.llama import canonical_from, check_llama_config, llama_config, name_map, write_directory
from megatier.model.params import canonical_shapes

SAVED_BY = {"qwen2_moe": "megatier-convert export or Qwen2MoeForCausalLM.save_pretrained",
            "qwen2": "megatier-convert export or Qwen2ForCausalLM.save_pretrained"}


def qwen2_name_map(m: ModelConfig) -> list[tuple[str, tuple[str, ...]]]:
    """(MegaTier name, the Hugging Face names stacked into it) for every tensor of the model."""
    names = [(ours, theirs) for ours, theirs in name_map(m.num_layers)
             if not (".mlp." in ours and is_moe_layer(m, int(ours.split(".")[1])))]
    for i in range(m.num_layers):
        hf = f"model.layers.{i}"
        if m.qkv_bias:
            names += [(f"layers.{i}.attn.q.bias", (f"{hf}.self_attn.q_proj.bias",)),
                      (f"layers.{i}.attn.kv.bias", (f"{hf}.self_attn.k_proj.bias", f"{hf}.self_attn.v_proj.bias"))]
        if is_moe_layer(m, i):
            names += _moe_layer_names(m, f"layers.{i}.moe", f"{hf}.mlp")
    return names


def _moe_layer_names(m: ModelConfig, ours: str, hf: str) -> list[tuple[str, tuple[str, ...]]]:
    names = [(f"{ours}.router.weight", (f"{hf}.gate.weight",))]
    experts = [(f"{ours}.experts.{e}", f"{hf}.experts.{e}") for e in range(m.moe.num_experts)]
    for mine, theirs in [*experts, (f"{ours}.shared", f"{hf}.shared_expert")]:
        names += [(f"{mine}.gate_up.weight", (f"{theirs}.gate_proj.weight", f"{theirs}.up_proj.weight")),
                  (f"{mine}.proj.weight", (f"{theirs}.down_proj.weight",))]
    return names + [(f"{ours}.shared_gate.weight", (f"{hf}.shared_expert_gate.weight",))]


def _renormalizes(m: ModelConfig) -> bool:
    return m.moe.router_norm == "topk_softmax" or m.moe.router_renormalize


def check_representable(m: ModelConfig) -> str:
    """The model_type of the Qwen model computing MegaTier's ``m`` ("qwen2_moe" with experts, "qwen2" without);
    refuses one that neither computes, naming the key and the fix."""
    if m.moe.num_experts == 0:
        if not m.qkv_bias:
            raise HFFormatError("Qwen2ForCausalLM cannot represent model.qkv_bias=false (its q, k and v projections "
                                "have biases); export it as a Llama")
        return "qwen2"
    if m.moe.shared_expert_hidden_size == 0:
        raise HFFormatError("Qwen2MoeForCausalLM cannot represent model.moe.shared_expert_hidden_size=0 (every MoE "
                            "layer has a gated shared expert); give the model one, or make it a model "
                            "MixtralForCausalLM computes (model.moe.layer_freq=1, the top-k weights renormalized, "
                            "model.qkv_bias=false)")
    return "qwen2_moe"


def qwen2_moe_config(m: ModelConfig, vocab_size: int, eod_id: Optional[int]) -> dict:
    """config.json of the Qwen2MoeForCausalLM (or, dense, Qwen2ForCausalLM) computing MegaTier's model ``m``."""
    config = {k: v for k, v in llama_config(m, vocab_size, eod_id).items() if k not in ("mlp_bias", "attention_bias")}
    config.update(use_sliding_window=False, sliding_window=None, max_window_layers=m.num_layers)
    if m.moe.num_experts == 0:
        return {**config, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    dense = [i for i in range(m.num_layers) if not is_moe_layer(m, i)]
    return {**config, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
            "qkv_bias": m.qkv_bias, "num_experts": m.moe.num_experts, "num_experts_per_tok": m.moe.top_k,
            "moe_intermediate_size": expert_ffn_size(m),
            "shared_expert_intermediate_size": m.moe.shared_expert_hidden_size,
            "norm_topk_prob": _renormalizes(m), "decoder_sparse_step": 1, "mlp_only_layers": dense,
            "router_aux_loss_coef": m.moe.aux_loss_coeff, "output_router_logits": False}


def hf_moe_layers(config: dict, path: str) -> list[int]:
    """The layers a Qwen2-MoE config.json makes mixtures of experts (see the module docstring)."""
    step, mlp_only = config.get("decoder_sparse_step", 1), config.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1:
        raise HFFormatError(f"{path}: decoder_sparse_step={step!r} must be a positive integer; re-save the model")
    layers = range(config.get("num_hidden_layers", 0)) if config.get("num_experts", 0) > 0 else range(0)
    return [i for i in layers if i not in mlp_only and (i + 1) % step == 0]


def _layer_freq_for(moe_layers: list[int], num_layers: int) -> Optional[int]:
    """The model.moe.layer_freq whose MoE layers are ``moe_layers``, if one is."""
    for freq in range(1, num_layers + 1):
        if moe_layers == list(range(0, num_layers, freq)):
            return freq
    return None


def _differences(config: dict, m: ModelConfig, path: str) -> list[tuple[str, object, str, object]]:
    """(Qwen key, its value, MegaTier key, the value that loads it) for every Qwen2-MoE setting that differs."""
    bias = config.get("qkv_bias", True)  # Qwen2's are always there
    rows = [("qkv_bias", bias, "model.qkv_bias", bias, m.qkv_bias)]
    if config["model_type"] == "qwen2_moe":
        experts, top_k = config.get("num_experts"), config.get("num_experts_per_tok")
        size, shared = config.get("moe_intermediate_size"), config.get("shared_expert_intermediate_size")
        norm = bool(config.get("norm_topk_prob", False))
        rows += [("num_experts", experts, "model.moe.num_experts", experts, m.moe.num_experts),
                 ("num_experts_per_tok", top_k, "model.moe.top_k", top_k, m.moe.top_k),
                 ("moe_intermediate_size", size, "model.moe.moe_ffn_hidden_size", size, expert_ffn_size(m)),
                 ("shared_expert_intermediate_size", shared, "model.moe.shared_expert_hidden_size", shared,
                  m.moe.shared_expert_hidden_size),
                 ("norm_topk_prob", norm, "model.moe.router_norm=softmax_topk model.moe.router_renormalize", norm,
                  _renormalizes(m))]
        layers = hf_moe_layers(config, path)
        freq = _layer_freq_for(layers, config.get("num_hidden_layers", 0))
        if freq is not None:
            rows.append(("MoE layers (decoder_sparse_step, mlp_only_layers)", layers, "model.moe.layer_freq", freq,
                         m.moe.layer_freq))
    return [(hf, theirs, ours, fix) for hf, theirs, ours, fix, mine in rows if fix != mine]


def check_qwen2_config(config: dict, m: ModelConfig, vocab_size: int, path: str) -> None:
    """Raise one line naming the Qwen2(-MoE) settings that differ from the MegaTier model or that it cannot
    compute."""
    differ = _differences(config, m, path)
    if differ:
        have = ", ".join(f"{hf}={theirs}" for hf, theirs, _, _ in differ)
        fix = " ".join(f"{ours}={str(value).lower() if isinstance(value, bool) else value}"
                       for _, _, ours, value in differ)
        raise HFFormatError(f"{path} holds a {config['model_type']} with {have}; set {fix} to load it")
    sliding = [t for t in config.get("layer_types") or [] if t != "full_attention"]
    cannot = [f"{key}={config.get(key)!r} (MegaTier attends to the whole sequence)" for key, ok in (
        ("use_sliding_window", not config.get("use_sliding_window", False)), ("layer_types", not sliding)) if not ok]
    moe_layers = hf_moe_layers(config, path)
    if config["model_type"] == "qwen2_moe" and _layer_freq_for(moe_layers, config.get("num_hidden_layers", 0)) is None:
        cannot.append(f"decoder_sparse_step={config.get('decoder_sparse_step', 1)!r} with mlp_only_layers="
                      f"{config.get('mlp_only_layers') or []!r}: MoE on layers {moe_layers} (MegaTier has MoE on "
                      f"layers 0, n, 2n, ...: model.moe.layer_freq=n)")
    if cannot:
        raise HFFormatError(f"{path}: MegaTier's Llama block cannot represent {'; '.join(cannot)}")
    dense = config["model_type"] == "qwen2" or len(moe_layers) < m.num_layers
    # Llama's checks on the rest (its biases are Qwen's, checked above; the dense size matters if a layer is dense)
    check_llama_config({**config, "attention_bias": False,
                        "intermediate_size": config.get("intermediate_size") if dense else ffn_size(m)},
                       m, vocab_size, path)


def export_qwen2(state: dict[str, torch.Tensor], model_cfg: ModelConfig, out_dir: str, *,
                 tokenizer: Optional[dict] = None) -> None:
    """Write ``out_dir`` so that ``Qwen2MoeForCausalLM.from_pretrained(out_dir)`` (``Qwen2ForCausalLM`` without
    experts) computes MegaTier's model."""
    check_representable(model_cfg)
    write_directory(state, model_cfg, out_dir, tokenizer, qwen2_name_map(model_cfg), qwen2_moe_config)


def load_qwen2(path: str, model_cfg: ModelConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    """The canonical state (fp32) of the Qwen2-MoE (or dense Qwen2) directory ``path`` for a model of
    ``model_cfg`` and vocabulary ``vocab_size``; HFFormatError with one line otherwise."""
    kind = "qwen2_moe" if model_cfg.moe.num_experts else "qwen2"
    path = os.path.expanduser(path)
    check_qwen2_config(read_config(path, kind, SAVED_BY[kind]), model_cfg, vocab_size, path)
    check_representable(model_cfg)  # after the directory's settings, which name the keys to set
    return canonical_from(path, qwen2_name_map(model_cfg), canonical_shapes(model_cfg, vocab_size))
