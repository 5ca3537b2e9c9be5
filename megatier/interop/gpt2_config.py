"""The non-tensor half of a Hugging Face GPT-2 directory: config.json and the tokenizer files.

``gpt2_config`` writes the GPT2Config of a MegaTier model (true vocabulary,
``gelu_new`` = the tanh GELU MegaTier uses, dropouts, LayerNorm epsilon) as a
plain dict, so exporting needs no transformers install. ``check_gpt2_config``
is its inverse for loading: it accepts only a GPT-2 whose function MegaTier
computes (tanh GELU, 1/sqrt(head_dim) attention scaling, tied head) and whose
shapes equal the model config's, and otherwise raises one line naming both
sides and the fix.

Tokenizers: the byte tokenizer has no files (ids are UTF-8 bytes, 256 ends a
document); a BPE tokenizer is one ``tokenizer.json`` (the `tokenizers` format
transformers' fast tokenizers read), copied with a ``tokenizer_config.json``.
"""
from __future__ import annotations

from typing import Optional

from megatier.config import ModelConfig
from megatier.config.schema import ffn_size
from megatier.interop.hf_files import HFFormatError, read_config

# GELU names transformers maps to the tanh approximation MegaTier's MLP computes.
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")


def gpt2_config(m: ModelConfig, vocab_size: int, eod_id: Optional[int]) -> dict:
    """config.json of the GPT2LMHeadModel computing the same function as a MegaTier model of config ``m``."""
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": vocab_size, "n_positions": m.max_position_embeddings, "n_embd": m.hidden_size,
        "n_layer": m.num_layers, "n_head": m.num_heads, "n_inner": ffn_size(m),
        "activation_function": "gelu_new", "layer_norm_epsilon": m.norm_eps, "initializer_range": m.init_std,
        # MegaTier drops out the embedding sum and each residual branch with hidden_dropout.
        "embd_pdrop": m.hidden_dropout, "resid_pdrop": m.hidden_dropout, "attn_pdrop": m.attention_dropout,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "add_cross_attention": False, "tie_word_embeddings": True,
        "bos_token_id": eod_id, "eos_token_id": eod_id, "dtype": "float32",
    }


def read_gpt2_config(path: str) -> dict:
    """The config.json of directory ``path``; refuses a missing directory, file, or another model_type."""
    return read_config(path, "gpt2", "megatier-convert export or GPT2LMHeadModel.save_pretrained")


def _function_mismatches(config: dict, m: ModelConfig) -> list[str]:
    """Settings of ``config`` under which GPT-2 would compute another function than MegaTier (with fixes)."""
    problems = []
    act = config.get("activation_function", "gelu_new")
    if act not in TANH_GELUS:
        problems.append(f"activation_function={act!r} (MegaTier computes the tanh GELU, gelu_new)")
    if not config.get("scale_attn_weights", True) or config.get("scale_attn_by_inverse_layer_idx", False):
        problems.append("attention scaling other than 1/sqrt(head_dim)")
    if config.get("add_cross_attention", False):
        problems.append("cross-attention layers")
    eps = config.get("layer_norm_epsilon", 1e-5)
    if eps != m.norm_eps:
        problems.append(f"layer_norm_epsilon={eps} (set model.norm_eps={eps})")
    return problems


def check_gpt2_config(config: dict, m: ModelConfig, vocab_size: int, path: str) -> None:
    """Raise one line naming every GPT-2 setting that differs from the MegaTier model and how to match it."""
    n_inner = config.get("n_inner") or 4 * config.get("n_embd", 0)
    pairs = [("n_layer", config.get("n_layer"), "model.num_layers", m.num_layers),
             ("n_embd", config.get("n_embd"), "model.hidden_size", m.hidden_size),
             ("n_head", config.get("n_head"), "model.num_heads", m.num_heads),
             ("n_inner", n_inner, "model.ffn_hidden_size", ffn_size(m)),
             ("n_positions", config.get("n_positions"), "model.max_position_embeddings", m.max_position_embeddings),
             ("vocab_size", config.get("vocab_size"), "model.vocab_size", vocab_size)]
    differ = [(hf, theirs, ours, mine) for hf, theirs, ours, mine in pairs if theirs != mine]
    if differ:
        have = ", ".join(f"{hf}={theirs}" for hf, theirs, _, _ in differ)
        want = ", ".join(f"{ours}={mine}" for _, _, ours, mine in differ)
        fix = " ".join(f"{ours}={theirs}" for _, theirs, ours, _ in differ)
        note = " (the data's vocabulary must fit in it)" if differ[-1][0] == "vocab_size" else ""
        raise HFFormatError(f"{path} holds a GPT-2 with {have} but the model has {want}; set {fix} to load it"
                              f"{note}")
    problems = _function_mismatches(config, m)
    if problems:
        raise HFFormatError(f"{path}: this GPT-2 computes another function than MegaTier's: "
                              f"{'; '.join(problems)}")
