"""A random Hugging Face Qwen2-MoE (or dense Qwen2) saved locally (nothing downloaded), shaped like a MegaTier
``model.arch=llama`` ModelConfig with ``model.qkv_bias`` (and ``model.moe`` with a shared expert), its weights
perturbed off their init (distinct routing, non-zero biases and router, non-trivial norms)."""
from __future__ import annotations

import torch

from megatier.config import ModelConfig
from megatier.config.schema import expert_ffn_size, ffn_size, is_moe_layer


def _shape(cfg: ModelConfig, vocab_size: int) -> dict:
    return dict(vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=ffn_size(cfg),
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_query_groups or cfg.num_heads,
                max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_eps,
                rope_theta=cfg.rope_theta, tie_word_embeddings=False, bos_token_id=vocab_size - 1,
                eos_token_id=vocab_size - 1)


def perturbed_and_saved(model, path: str, seed: int):
    """``model`` with seeded noise on every weight (so no tensor keeps an init a mapping bug could hide behind),
    saved to ``path``; returned in eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    model.save_pretrained(path)
    return model.eval()


def save_random_qwen2_moe(path: str, cfg: ModelConfig, vocab_size: int, seed: int = 0, **overrides):
    """Save a Qwen2MoeForCausalLM of ``cfg``'s shape (MoE on MegaTier's layers: the others in mlp_only_layers);
    returns it in eval mode."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    e = cfg.moe
    config = Qwen2MoeConfig(**_shape(cfg, vocab_size), qkv_bias=cfg.qkv_bias, num_experts=e.num_experts,
                            num_experts_per_tok=e.top_k, moe_intermediate_size=expert_ffn_size(cfg),
                            shared_expert_intermediate_size=e.shared_expert_hidden_size,
                            norm_topk_prob=e.router_norm == "topk_softmax" or e.router_renormalize,
                            decoder_sparse_step=1, router_aux_loss_coef=e.aux_loss_coeff,
                            mlp_only_layers=[i for i in range(cfg.num_layers) if not is_moe_layer(cfg, i)],
                            **overrides)
    torch.manual_seed(seed)
    return perturbed_and_saved(Qwen2MoeForCausalLM(config), path, seed)


def save_random_qwen2(path: str, cfg: ModelConfig, vocab_size: int, seed: int = 0):
    """Save a dense Qwen2ForCausalLM of ``cfg``'s shape; returns it in eval mode."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    return perturbed_and_saved(Qwen2ForCausalLM(Qwen2Config(**_shape(cfg, vocab_size))), path, seed)
