"""GPT-2 and Llama blocks on Transformer Engine's layers (``model.impl=te``), and its fp8 autocast
(``train.precision=fp8``).

A :class:`TEBlock` computes the function of the native ``gpt.Block`` (pre-LayerNorm, causal attention through
``scaled_dot_product_attention``, tanh GELU MLP, the same tensor-parallel split) with three TE layers::

    ln_qkv    te.LayerNormLinear(h, 3h)   column parallel: ln1 fused into the q/k/v projection
    attn_out  te.Linear(h, h)             row parallel: output all-reduced over tp, then the bias added once
    ln_mlp    te.LayerNormMLP(h, ffn)     ln2, fc (column), GELU (TE's "gelu" is the tanh approximation), proj (row)

A :class:`TELlamaBlock` computes the native ``llama.LlamaBlock`` with the same three layers, configured for it::

    ln_qkv    te.LayerNormLinear(h, (nh + 2 g) hd, normalization="RMSNorm", parameters_split={"q", "kv"})
    attn_out  te.Linear(nh hd, h)           row parallel
    ln_mlp    te.LayerNormMLP(h, ffn, normalization="RMSNorm", activation="swiglu")

no biases; rotary positions and grouped-query attention between ``ln_qkv`` and ``attn_out`` are the native
block's own code (``llama.GroupedAttention``). ``parameters_split`` (sizes of the whole layer, which TE divides by
tp) makes TE hold this rank's q rows and its k-then-v rows as two Parameters, the native ``attn.q`` and
``attn.kv``; TE's swiglu applies SiLU to the first half of fc1's output per rank, which is the native
``mlp.gate_up``'s gate half (its rows split over tp with stride 2).

Parameter names. Checkpoints, the flat buffer's segment table, initialisation and the canonical state all go by
the native names (``layers.7.ln1.weight``, ``layers.7.attn.qkv.weight``, ...), which TE's layers do not have
(``layer_norm_weight``, ``fc1_weight``, ...), and one TE layer holds parameters of two native modules (ln1 and
qkv). So each TE layer's parameters are *moved* to the native names: after a TE layer is built, each of its
Parameter objects is taken out of the layer's parameter registry and registered on a holder module under the
native name (``ln1.weight``, ``attn.qkv.weight``, ...), and left on the TE layer as a plain attribute, which is how
TE's forward reads it (``getattr``). The TE layers are then parameter-free children: ``named_parameters`` yields
exactly the native names, in the native order, with the native shapes and partition metadata (``tp_partition_dim``
and stride, qkv's stride 3), so ``FlatLayout``, ``GradBuffer``, ``init_weights`` and every checkpoint are the same
for both implementations, and a run may switch ``model.impl`` between launches. Moving a Parameter's data
(``module.to``, ``flatten_parameters``' ``p.data = view``) keeps the object, so the TE layer always computes with
the flat buffer's values. Every value is set by ``init_weights`` from the canonical seeds, so TE's own
initialisers are skipped.

TE's layers run on CUDA only (config validation requires it); they are built on the CPU like the rest of the model
(TE allows any ``device`` at construction) and moved with it. TE keeps per-layer fp8 scaling state (amax history)
outside the parameters: it is not checkpointed, so a restore starts fp8 scaling afresh.
"""
from __future__ import annotations

import contextlib
import importlib
from types import ModuleType

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatier.config import ModelConfig
from megatier.config.schema import ffn_size
from megatier.model.llama import GroupedAttention
from megatier.parallel.layers import mark_partition


def _te() -> ModuleType:
    return importlib.import_module("transformer_engine.pytorch")


def _leave(weight: torch.Tensor) -> None:
    """TE's initialiser for matrices: nothing (init_weights sets every parameter from the canonical seeds)."""


class _Holder(nn.Module):
    """Holds moved TE parameters under a native module's names (``weight``, ``bias``); has no forward."""


def _move(te_layer: nn.Module, te_name: str, holder: nn.Module, name: str, tp_dim, stride: int = 1) -> None:
    """Register ``te_layer.<te_name>`` as ``holder.<name>`` (with its tp split) and leave it as a plain attribute of
    ``te_layer``, no longer one of its parameters (see the module docstring)."""
    param = getattr(te_layer, te_name)
    delattr(te_layer, te_name)  # out of te_layer's parameter registry
    object.__setattr__(te_layer, te_name, param)  # still te_layer.<te_name> for TE's forward
    holder.register_parameter(name, mark_partition(param, tp_dim, stride))


def _holder(te_layer: nn.Module, **names) -> _Holder:
    """A holder with ``name=(te_name, tp_dim, stride)`` moved from ``te_layer``."""
    holder = _Holder()
    for name, (te_name, tp_dim, stride) in names.items():
        _move(te_layer, te_name, holder, name, tp_dim, stride)
    return holder


class TEBlock(nn.Module):
    """The native ``Block`` on TE layers: x + drop(attn(ln1(x))), then x + drop(mlp(ln2(x))) on (b, s, h)."""

    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup, hidden_dropout: nn.Module):
        super().__init__()
        te = _te()
        h, ffn = cfg.hidden_size, cfg.ffn_hidden_size or 4 * cfg.hidden_size
        tp = dist.get_world_size(group)
        self.local_heads = cfg.num_heads // tp
        self.head_dim = h // cfg.num_heads
        self.attention_dropout = cfg.attention_dropout
        common = dict(tp_group=group, tp_size=tp, bias=True, params_dtype=torch.float32, device="cpu",
                      init_method=_leave)
        ln_qkv = te.LayerNormLinear(h, 3 * h, eps=cfg.norm_eps, parallel_mode="column", **common)
        attn_out = te.Linear(h, h, parallel_mode="row", **common)
        ln_mlp = te.LayerNormMLP(h, ffn, eps=cfg.norm_eps, activation="gelu", set_parallel_mode=True,
                                 output_layer_init_method=_leave, **common)
        # The native names, in the native Block's order (ln1, attn.qkv, attn.proj, ln2, mlp.fc, mlp.proj) and with
        # its tp splits: qkv rows in 3 blocks (stride 3), proj and the MLP's second matrix by input columns.
        self.ln1 = _holder(ln_qkv, weight=("layer_norm_weight", None, 1), bias=("layer_norm_bias", None, 1))
        self.attn = nn.Module()
        self.attn.qkv = _holder(ln_qkv, weight=("weight", 0, 3), bias=("bias", 0, 3))
        self.attn.proj = _holder(attn_out, weight=("weight", 1, 1), bias=("bias", None, 1))
        self.ln2 = _holder(ln_mlp, weight=("layer_norm_weight", None, 1), bias=("layer_norm_bias", None, 1))
        self.mlp = nn.Module()
        self.mlp.fc = _holder(ln_mlp, weight=("fc1_weight", 0, 1), bias=("fc1_bias", 0, 1))
        self.mlp.proj = _holder(ln_mlp, weight=("fc2_weight", 1, 1), bias=("fc2_bias", None, 1))
        # The computing layers, parameter-free from here on.
        self.ln_qkv, self.attn_out, self.ln_mlp = ln_qkv, attn_out, ln_mlp
        self.hidden_dropout = hidden_dropout

    def _attention(self, qkv: torch.Tensor) -> torch.Tensor:
        """Causal self-attention of this rank's heads: (b, s, 3h/tp) -> (b, s, h/tp), as the native Attention."""
        b, s, _ = qkv.shape
        qkv = qkv.view(b, s, 3, self.local_heads, self.head_dim)  # (b, s, 3, nh/tp, hd)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (b, nh/tp, s, hd)
        dropout = self.attention_dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        return out.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.hidden_dropout(self.attn_out(self._attention(self.ln_qkv(x))))
        return x + self.hidden_dropout(self.ln_mlp(x))


class TELlamaBlock(nn.Module):
    """The native ``LlamaBlock`` on TE layers: x + drop(attn(rms1(x))), then x + drop(swiglu(rms2(x)))."""

    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup, hidden_dropout: nn.Module):
        super().__init__()
        te = _te()
        tp = dist.get_world_size(group)
        self.heads = GroupedAttention(cfg, tp)
        h, hd, groups = cfg.hidden_size, self.heads.head_dim, cfg.num_query_groups or cfg.num_heads
        q_size, kv_size = cfg.num_heads * hd, 2 * groups * hd
        common = dict(tp_group=group, tp_size=tp, bias=False, params_dtype=torch.float32, device="cpu",
                      init_method=_leave)
        ln_qkv = te.LayerNormLinear(h, q_size + kv_size, eps=cfg.norm_eps, normalization="RMSNorm",
                                    parallel_mode="column", parameters_split={"q": q_size, "kv": kv_size}, **common)
        attn_out = te.Linear(q_size, h, parallel_mode="row", **common)
        ln_mlp = te.LayerNormMLP(h, ffn_size(cfg), eps=cfg.norm_eps, normalization="RMSNorm", activation="swiglu",
                                 set_parallel_mode=True, output_layer_init_method=_leave, **common)
        # The native LlamaBlock's names, order and tp splits (kv and gate_up rows in two blocks: stride 2).
        self.ln1 = _holder(ln_qkv, weight=("layer_norm_weight", None, 1))
        self.attn = nn.Module()
        self.attn.q = _holder(ln_qkv, weight=("q_weight", 0, 1))
        self.attn.kv = _holder(ln_qkv, weight=("kv_weight", 0, 2))
        self.attn.proj = _holder(attn_out, weight=("weight", 1, 1))
        self.ln2 = _holder(ln_mlp, weight=("layer_norm_weight", None, 1))
        self.mlp = nn.Module()
        self.mlp.gate_up = _holder(ln_mlp, weight=("fc1_weight", 0, 2))
        self.mlp.proj = _holder(ln_mlp, weight=("fc2_weight", 1, 1))
        self.ln_qkv, self.attn_out, self.ln_mlp = ln_qkv, attn_out, ln_mlp
        self.split = (q_size // tp, kv_size // tp)
        self.hidden_dropout = hidden_dropout

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, kv = self.ln_qkv(x).split(self.split, dim=-1)
        x = x + self.hidden_dropout(self.attn_out(self.heads(q, kv, cos, sin, self.training)))
        return x + self.hidden_dropout(self.ln_mlp(x))


def fp8_recipe():
    """The delayed-scaling recipe of train.precision=fp8: E4M3 forward, E5M2 gradients (HYBRID), TE's defaults for
    the amax history; no amax reduction across ranks, as every tensor an fp8 GEMM quantizes is this rank's own
    (no sequence parallelism: a tp rank's inputs are replicated or its own slice), which also keeps the forward
    free of collectives between pipeline stages."""
    recipe = importlib.import_module("transformer_engine.common.recipe")
    return recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, reduce_amax=False)


def fp8_autocast(recipe) -> contextlib.AbstractContextManager:
    """TE's fp8 autocast with ``recipe`` around a forward, or nothing when ``recipe`` is None."""
    if recipe is None:
        return contextlib.nullcontext()
    return _te().autocast(enabled=True, recipe=recipe)
