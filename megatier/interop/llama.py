"""Exchange weights with Hugging Face Llama (``transformers.LlamaForCausalLM``) for ``model.arch=llama``.

The canonical state is MegaTier parameter name -> full, unsharded, unpadded fp32 tensor (the names of
:func:`megatier.model.params.canonical_shapes`). Name map (per layer i; every weight a Linear's (out, in))::

    word.weight                 model.embed_tokens.weight
    layers.i.ln1.weight         model.layers.i.input_layernorm.weight
    layers.i.attn.q.weight      model.layers.i.self_attn.q_proj.weight
    layers.i.attn.kv.weight     model.layers.i.self_attn.k_proj.weight and v_proj.weight, stacked (k first)
    layers.i.attn.proj.weight   model.layers.i.self_attn.o_proj.weight
    layers.i.ln2.weight         model.layers.i.post_attention_layernorm.weight
    layers.i.mlp.gate_up.weight model.layers.i.mlp.gate_proj.weight and up_proj.weight, stacked (gate first)
    layers.i.mlp.proj.weight    model.layers.i.mlp.down_proj.weight
    final_norm.weight           model.norm.weight
    head_weight                 lm_head.weight

Loading refuses what MegaTier's block does not compute, naming the key: biases, a rope scaling, another
activation than SiLU, a head dimension other than hidden / heads, a head tied to the embedding.
"""
from __future__ import annotations

import os
from typing import Optional

import torch

from megatier.config import ModelConfig
from megatier.config.schema import ffn_size
from megatier.interop.hf_files import (
    HFFormatError,
    check_state,
    prepare_out_dir,
    read_config,
    read_tensors,
    write_model,
    write_tokenizer,
)
from megatier.model.params import canonical_shapes

# (MegaTier suffix, Hugging Face suffixes stacked into it) of every tensor of block i.
_BLOCK = [("ln1.weight", ("input_layernorm.weight",)),
          ("attn.q.weight", ("self_attn.q_proj.weight",)),
          ("attn.kv.weight", ("self_attn.k_proj.weight", "self_attn.v_proj.weight")),
          ("attn.proj.weight", ("self_attn.o_proj.weight",)),
          ("ln2.weight", ("post_attention_layernorm.weight",)),
          ("mlp.gate_up.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
          ("mlp.proj.weight", ("mlp.down_proj.weight",))]
SAVED_BY = "megatier-convert export or LlamaForCausalLM.save_pretrained"


def name_map(num_layers: int) -> list[tuple[str, tuple[str, ...]]]:
    """(MegaTier name, the Hugging Face names stacked into it) for every tensor of the model."""
    names = [("word.weight", ("model.embed_tokens.weight",))]
    for i in range(num_layers):
        names += [(f"layers.{i}.{ours}", tuple(f"model.layers.{i}.{t}" for t in theirs)) for ours, theirs in _BLOCK]
    return names + [("final_norm.weight", ("model.norm.weight",)), ("head_weight", ("lm_head.weight",))]


def llama_config(m: ModelConfig, vocab_size: int, eod_id: Optional[int]) -> dict:
    """config.json of the LlamaForCausalLM computing the same function as a MegaTier model of config ``m``."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
        "hidden_size": m.hidden_size, "intermediate_size": ffn_size(m), "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_query_groups or m.num_heads,
        "head_dim": m.hidden_size // m.num_heads, "max_position_embeddings": m.max_position_embeddings,
        "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta, "rope_scaling": None, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "attention_dropout": m.attention_dropout,
        "tie_word_embeddings": False, "initializer_range": m.init_std, "bos_token_id": eod_id,
        "eos_token_id": eod_id, "dtype": "float32",
    }


def _rope(config: dict) -> tuple[float, object]:
    """(theta, scaling) of a config.json as either transformers generation writes it: ``rope_parameters``
    (``rope_theta`` and ``rope_type`` inside), or ``rope_theta`` and ``rope_scaling`` at the top."""
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        scaling = None if params.get("rope_type", "default") == "default" else params
        return float(params.get("rope_theta", 10000.0)), scaling or config.get("rope_scaling")
    return float(config.get("rope_theta", 10000.0)), config.get("rope_scaling")


def check_llama_config(config: dict, m: ModelConfig, vocab_size: int, path: str) -> None:
    """Raise one line naming every Llama setting that differs from the MegaTier model and how to match it, or
    that MegaTier's block cannot represent."""
    heads = config.get("num_attention_heads")
    theta, scaling = _rope(config)
    pairs = [("num_hidden_layers", config.get("num_hidden_layers"), "model.num_layers", m.num_layers),
             ("hidden_size", config.get("hidden_size"), "model.hidden_size", m.hidden_size),
             ("num_attention_heads", heads, "model.num_heads", m.num_heads),
             ("num_key_value_heads", config.get("num_key_value_heads", heads), "model.num_query_groups",
              m.num_query_groups or m.num_heads),
             ("intermediate_size", config.get("intermediate_size"), "model.ffn_hidden_size", ffn_size(m)),
             ("max_position_embeddings", config.get("max_position_embeddings"), "model.max_position_embeddings",
              m.max_position_embeddings),
             ("rope_theta", theta, "model.rope_theta", m.rope_theta),
             ("rms_norm_eps", config.get("rms_norm_eps", 1e-6), "model.norm_eps", m.norm_eps),
             ("vocab_size", config.get("vocab_size"), "model.vocab_size", vocab_size)]
    differ = [(hf, theirs, ours, mine) for hf, theirs, ours, mine in pairs if theirs != mine]
    if differ:
        have = ", ".join(f"{hf}={theirs}" for hf, theirs, _, _ in differ)
        want = ", ".join(f"{ours}={mine}" for _, _, ours, mine in differ)
        fix = " ".join(f"{ours}={theirs}" for _, theirs, ours, _ in differ)
        raise HFFormatError(f"{path} holds a Llama with {have} but the model has {want}; set {fix} to load it")
    head_dim = config.get("head_dim") or (config.get("hidden_size", 0) // max(1, heads or 1))
    cannot = [f"{key}={scaling if key == 'rope_scaling' else config.get(key)!r}" for key, ok in (
        ("rope_scaling", scaling in (None, {})),
        ("hidden_act", config.get("hidden_act", "silu") == "silu"),
        ("attention_bias", not config.get("attention_bias", False)),
        ("mlp_bias", not config.get("mlp_bias", False)),
        ("tie_word_embeddings", not config.get("tie_word_embeddings", False)),
        ("head_dim", head_dim == m.hidden_size // m.num_heads)) if not ok]
    if cannot:
        raise HFFormatError(f"{path}: MegaTier's Llama block cannot represent {', '.join(cannot)} (it has no "
                            f"biases, no rope scaling, SiLU, hidden_size / num_attention_heads per head and an "
                            f"untied head)")


def export_llama(state: dict[str, torch.Tensor], model_cfg: ModelConfig, out_dir: str, *,
                 tokenizer: Optional[dict] = None) -> None:
    """Write ``out_dir`` so that ``LlamaForCausalLM.from_pretrained(out_dir)`` computes MegaTier's model (the
    canonical state of a ``model.arch=llama`` job; ``tokenizer`` as :func:`megatier.interop.gpt2.export_gpt2`)."""
    write_directory(state, model_cfg, out_dir, tokenizer, name_map(model_cfg.num_layers), llama_config)


def write_directory(state: dict[str, torch.Tensor], model_cfg: ModelConfig, out_dir: str, tokenizer: Optional[dict],
                    pairs: list[tuple[str, tuple[str, ...]]], make_config) -> None:
    """The Hugging Face directory of ``state``: each canonical tensor of ``pairs`` cut into the named tensors it
    joins, the tokenizer, and ``make_config(model_cfg, vocab, eod)`` as config.json."""
    vocab = check_state(state, model_cfg)
    prepare_out_dir(out_dir)
    eod = write_tokenizer(out_dir, tokenizer, model_cfg.max_position_embeddings)
    tensors = {}
    for ours, theirs in pairs:
        value = state[ours].detach().to(device="cpu", dtype=torch.float32)
        for name, part in zip(theirs, value.chunk(len(theirs), dim=0)):
            tensors[name] = part.clone()
    write_model(out_dir, tensors, make_config(model_cfg, vocab, eod))


def load_llama(path: str, model_cfg: ModelConfig, vocab_size: int) -> dict[str, torch.Tensor]:
    """The canonical state (fp32) of the Llama directory ``path`` for a model of ``model_cfg`` and vocabulary
    ``vocab_size``; HFFormatError with one line otherwise."""
    path = os.path.expanduser(path)
    check_llama_config(read_config(path, "llama", SAVED_BY), model_cfg, vocab_size, path)
    return canonical_from(path, name_map(model_cfg.num_layers), canonical_shapes(model_cfg, vocab_size))


def canonical_from(path: str, pairs: list[tuple[str, tuple[str, ...]]], expected: dict) -> dict[str, torch.Tensor]:
    """The canonical tensors (fp32) of ``pairs`` (ours, the Hugging Face names concatenated into it) from the
    weights of ``path``, each of its ``expected`` shape; HFFormatError with one line otherwise."""
    tensors = {k: v for k, v in read_tensors(path).items() if not k.endswith("rotary_emb.inv_freq")}
    wanted = {name for _, theirs in pairs for name in theirs}
    unexpected, missing = sorted(tensors.keys() - wanted), sorted(wanted - tensors.keys())
    if unexpected or missing:
        raise HFFormatError(f"{path}: the weights do not match its config.json (missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]}); re-save the model with save_pretrained")
    state = {}
    for ours, theirs in pairs:
        value = torch.cat([tensors[name].to(torch.float32) for name in theirs], dim=0)
        if tuple(value.shape) != expected[ours]:
            raise HFFormatError(f"{path}: {' and '.join(theirs)} give shape {tuple(value.shape)} where its "
                                f"config.json implies {expected[ours]}; re-save the model with save_pretrained")
        state[ours] = value
    return state
