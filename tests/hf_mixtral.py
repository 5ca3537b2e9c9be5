"""A random Hugging Face Mixtral saved locally (nothing downloaded), shaped like a MegaTier ``model.arch=llama``
ModelConfig with ``model.moe``, its weights perturbed off their init (distinct routing, non-trivial norms)."""
from __future__ import annotations

import torch

from megatier.config import ModelConfig
from megatier.config.schema import expert_ffn_size
from tests.hf_qwen2_moe import perturbed_and_saved


def save_random_mixtral(path: str, cfg: ModelConfig, vocab_size: int, seed: int = 0, **overrides):
    """Save a MixtralForCausalLM of ``cfg``'s shape; returns it in eval mode."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=expert_ffn_size(cfg),
                           num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                           num_key_value_heads=cfg.num_query_groups or cfg.num_heads,
                           max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_eps,
                           rope_theta=cfg.rope_theta, tie_word_embeddings=False,
                           num_local_experts=cfg.moe.num_experts, num_experts_per_tok=cfg.moe.top_k,
                           router_aux_loss_coef=cfg.moe.aux_loss_coeff, bos_token_id=vocab_size - 1,
                           eos_token_id=vocab_size - 1, **overrides)
    torch.manual_seed(seed)
    return perturbed_and_saved(MixtralForCausalLM(config), path, seed)
