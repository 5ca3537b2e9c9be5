"""A torchtitan Llama job on CPU for the interop tests: its model, AdamW container, LR schedulers and
CheckpointManager, built for a MegaTier ``ModelConfig``.

torchtitan 0.3's model package imports its expert-parallel Triton kernels at import time although a dense
Llama never runs them; without Triton (a CPU machine) :func:`import_torchtitan` puts an empty module in their
place. torchtitan's Llama attends with FlexAttention or varlen, neither of which has a backward on CPU, so the
attention core (softmax(q k^T / sqrt(d)) v under the causal mask, after torchtitan's projections and rotary
embedding) is :class:`CausalCore`, torch's SDPA. The rotary embedding is unscaled as MegaTier's is.
"""
from __future__ import annotations

import importlib.util
import sys
import types
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from megatier.config import ModelConfig, OptimConfig
from megatier.config.schema import ffn_size


def import_torchtitan():
    """torchtitan's Llama module, or skip the test without torchtitan."""
    pytest.importorskip("torchtitan")
    if importlib.util.find_spec("triton") is None:
        stub = types.ModuleType("torchtitan.distributed.minimal_async_ep.kernels")
        stub.__getattr__ = lambda name: None  # the EP kernels a dense model never launches
        sys.modules.setdefault(stub.__name__, stub)
    import torchtitan.models.llama3 as llama3
    return llama3


class CausalCore(torch.nn.Module):
    """torchtitan's inner attention, (B, L, N, H) in and out, as causal SDPA."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


def build_model(m: ModelConfig, vocab: int, seed: int = 0) -> torch.nn.Module:
    llama3 = import_torchtitan()
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    h, heads = m.hidden_size, m.num_heads
    cfg = llama3.Llama3Model.Config(
        dim=h, vocab_size=vocab, tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=h),
        norm=RMSNorm.Config(normalized_shape=h, eps=m.norm_eps),
        lm_head=Linear.Config(in_features=h, out_features=vocab),
        layers=llama3._build_llama3_layers(
            n_layers=m.num_layers, dim=h, n_heads=heads, n_kv_heads=m.num_query_groups, hidden_dim=ffn_size(m),
            rope=ComplexRoPE.Config(dim=h // heads, max_seq_len=m.max_position_embeddings, theta=m.rope_theta),
            attn_backend="flex"))
    for layer in cfg.layers:
        layer.attention_norm.eps = layer.ffn_norm.eps = m.norm_eps
    torch.manual_seed(seed)
    model = cfg.build()
    for layer in model.layers.values():
        layer.attention.inner_attention = CausalCore()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05 + (1.0 if p.dim() == 1 else 0.0))
    return model


def loss_of(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    logits = model(tokens, positions=positions)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


@dataclass
class TitanJob:
    model: torch.nn.Module
    optimizers: object
    schedulers: object
    checkpointer: object
    train_state: object


class _TrainState:
    """What torchtitan's Trainer registers as ``train_state``."""

    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def build_job(m: ModelConfig, vocab: int, o: OptimConfig, folder: str, seed: int = 0) -> TitanJob:
    """torchtitan's components as its Trainer wires them: AdamW (norms without weight decay, as MegaTier), a
    constant LR after ``o.warmup_iters`` linear warmup steps, a CheckpointManager saving the full state."""
    import_torchtitan()
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig
    model = build_model(m, vocab, seed)
    kw = {"lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps}
    groups = [ParamGroupConfig(pattern=r"norm\.weight$", optimizer_name="AdamW",
                               optimizer_kwargs={**kw, "weight_decay": 0.0}),
              ParamGroupConfig(pattern=r".*", optimizer_name="AdamW",
                               optimizer_kwargs={**kw, "weight_decay": o.weight_decay})]
    optimizers = OptimizersContainer(OptimizersContainer.Config(param_groups=groups, implementation="for-loop"),
                                     model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=o.warmup_iters, decay_ratio=0.0).build(
        optimizers=optimizers, training_steps=1000)
    state = _TrainState()
    checkpointer = CheckpointManager(CheckpointManager.Config(enable=True, folder="ckpt", interval=1, keep_latest_k=0,
                                                             last_save_model_only=False),
                                     dataloader=None, model_parts=[model], optimizers=optimizers,
                                     lr_schedulers=schedulers, states={"train_state": state}, sd_adapter=None,
                                     base_folder=folder)
    return TitanJob(model, optimizers, schedulers, checkpointer, state)


def train_step(job: TitanJob, tokens: torch.Tensor, labels: torch.Tensor) -> float:
    """One step of torchtitan's loop: forward, backward, optimizer and scheduler step, counters."""
    job.optimizers.zero_grad()
    loss = loss_of(job.model, tokens, labels)
    loss.backward()
    job.optimizers.step()
    job.schedulers.step()
    job.train_state.step += 1
    job.train_state.ntokens_seen += tokens.numel()
    return float(loss.detach())
