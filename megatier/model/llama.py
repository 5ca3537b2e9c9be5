"""The Llama-family block on the tensor-parallel layers: RMSNorm, rotary positions, grouped-query attention, a
SwiGLU MLP, no biases but Qwen2's optional ones on q, k and v (``model.qkv_bias``) (``model.arch=llama``). It
computes what ``transformers.LlamaForCausalLM``'s (or Qwen2's) decoder layer computes, in the same order of
operations, so the two agree to float rounding (the tests hold them to it).

Parameters, with the Hugging Face tensors they hold (:mod:`megatier.interop.llama`):

    ln1.weight          input_layernorm.weight
    attn.q.weight       self_attn.q_proj.weight                     column-parallel: q heads cut across tp
    attn.q.bias         self_attn.q_proj.bias                       with ``model.qkv_bias``, cut as q's rows
    attn.kv.weight      k_proj.weight and v_proj.weight, stacked     column-parallel, stride 2: each rank keeps
                                                                     its k heads and its v heads
    attn.kv.bias        k_proj.bias and v_proj.bias, stacked         with ``model.qkv_bias``, cut as kv's rows
    attn.proj.weight    self_attn.o_proj.weight                     row-parallel
    ln2.weight          post_attention_layernorm.weight
    mlp.gate_up.weight  gate_proj.weight and up_proj.weight, stacked column-parallel, stride 2
    mlp.proj.weight     mlp.down_proj.weight                        row-parallel

A mixture-of-experts layer (``model.moe``; megatier.model.moe) has ``moe.*`` in place of ``mlp.*``.

Grouped-query attention: tp must divide the key/value heads (``num_query_groups``), so every rank holds whole
groups and the query heads that read them.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatier.config import ModelConfig
from megatier.config.schema import ffn_size
from megatier.model.moe import MoELayer
from megatier.model.recompute import recomputed
from megatier.parallel.layers import ColumnParallelLinear, RowParallelLinear, mark_partition


class RMSNorm(nn.Module):
    """x / rms(x) * weight, in float32 and cast back (as Hugging Face's LlamaRMSNorm)."""

    def __init__(self, hidden_size: int, eps: float, sequence_parallel: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = mark_partition(nn.Parameter(torch.ones(hidden_size)), None)
        if sequence_parallel:  # applied to this rank's tokens: its gradient is a partial sum over tp
            self.weight.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary_tables(seq_len: int, head_dim: int, theta: float, device: torch.device,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (seq_len, head_dim) of the rotary embedding at positions 0..seq_len-1, computed in float32
    (the frequencies repeated for the two halves of a head, as Hugging Face's rotate_half convention wants)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (b, heads, s, hd) rotated by position."""
    return x * cos + _rotate_half(x) * sin


class GroupedAttention:
    """The attention of a rank's heads between the projections, shared by the native and the Transformer Engine
    block: (b, s, nh/tp * hd) queries and (b, s, 2 g/tp * hd) keys-then-values in, (b, s, nh/tp * hd) out, with
    rotary positions on q and k, each key/value head serving nh/g query heads, causal ``scaled_dot_product_attention``
    (``recompute`` the core in the backward: ``model.recompute=selective``)."""

    def __init__(self, cfg: ModelConfig, tp: int):
        groups = cfg.num_query_groups or cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.local_heads, self.local_groups = cfg.num_heads // tp, groups // tp
        self.dropout = cfg.attention_dropout
        self.selective = cfg.recompute == "selective"

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float) -> torch.Tensor:
        repeat = self.local_heads // self.local_groups  # each key/value head serves this many query heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)

    def __call__(self, q: torch.Tensor, kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 training: bool) -> torch.Tensor:
        b, s, _ = q.shape
        q = q.view(b, s, self.local_heads, self.head_dim).transpose(1, 2)  # (b, nh/tp, s, hd)
        k, v = kv.view(b, s, 2, self.local_groups, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)  # (b, g/tp, s, hd)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        dropout = self.dropout if training else 0.0
        if self.selective and training:
            out = recomputed(self._core, q, k, v, dropout)
        else:
            out = self._core(q, k, v, dropout)
        return out.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup, sequence_parallel: bool = False):
        super().__init__()
        groups = cfg.num_query_groups or cfg.num_heads
        self.heads = GroupedAttention(cfg, dist.get_world_size(group))
        h, hd = cfg.hidden_size, self.heads.head_dim
        self.q = ColumnParallelLinear(h, cfg.num_heads * hd, group=group, bias=cfg.qkv_bias,
                                      sequence_parallel=sequence_parallel)
        self.kv = ColumnParallelLinear(h, 2 * groups * hd, group=group, bias=cfg.qkv_bias, stride=2,
                                       sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(cfg.num_heads * hd, h, group=group, bias=False,
                                      sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # q and kv of the whole sequence (gathered first under sequence parallelism)
        out = self.heads(self.q(x), self.kv(x), cos, sin, self.training)
        return self.proj(out)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up as one column-parallel linear of stride 2."""

    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup, sequence_parallel: bool = False):
        super().__init__()
        ffn = ffn_size(cfg)
        self.gate_up = ColumnParallelLinear(cfg.hidden_size, 2 * ffn, group=group, bias=False, stride=2,
                                            sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(ffn, cfg.hidden_size, group=group, bias=False,
                                      sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)


class LlamaBlock(nn.Module):
    """Attention, then the SwiGLU MLP (``mlp``) or, with ``moe``, a mixture of experts (``moe``)."""

    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup, hidden_dropout: nn.Module,
                 sequence_parallel: bool = False, moe: bool = False, ep_group: dist.ProcessGroup | None = None):
        super().__init__()
        self.ln1 = RMSNorm(cfg.hidden_size, cfg.norm_eps, sequence_parallel)
        self.attn = LlamaAttention(cfg, group, sequence_parallel)
        self.ln2 = RMSNorm(cfg.hidden_size, cfg.norm_eps, sequence_parallel)
        if moe:
            self.moe = MoELayer(cfg, group, sequence_parallel, ep_group)
        else:
            self.mlp = SwiGLU(cfg, group, sequence_parallel)
        self.hidden_dropout = hidden_dropout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.hidden_dropout(self.attn(self.ln1(x), cos, sin))
        ffn = self.moe if hasattr(self, "moe") else self.mlp
        return x + self.hidden_dropout(ffn(self.ln2(x)))
