"""Mixture-of-experts layers of the Llama family (``model.moe.*``): a router, SwiGLU experts, an optional shared
expert, dropless top-k routing, and the router losses the stage adds to the training loss.

Per MoE layer the dense MLP is replaced by (names without the ``layers.<i>.`` prefix; megatier.model.params)::

    moe.router.weight                 (E, h)        replicated; with sequence parallelism it sees this rank's
                                                    tokens, so its gradient is a partial sum over tp
    moe.experts.<e>.gate_up.weight    (2 f, h)      column-parallel, stride 2 (gate then up), as the dense MLP
    moe.experts.<e>.proj.weight       (h, f)        row-parallel
    moe.shared.gate_up.weight         (2 s, h)      the shared expert (model.moe.shared_expert_hidden_size)
    moe.shared.proj.weight            (h, s)
    moe.shared_gate.weight            (1, h)        its sigmoid gate, replicated as the router

Routing (the function transformers' Mixtral and Qwen2-MoE compute): p = softmax(router logits) over all experts;
each token goes to the top_k experts of p, weighted by their p renormalized to sum 1 ("topk_softmax", equal to a
softmax over the top-k logits) or as they are ("softmax_topk" without ``router_renormalize``). Dropless: every
token reaches all its experts; each expert runs on the tokens routed to it (grouped by a stable sort; once per
source rank under expert parallelism), and experts no token chose run on none, so every parameter takes part
in every step.

Expert parallelism (``parallel.ep``; ``ep_group``): each rank holds num_experts / ep experts, named by their
global index; the tokens go to their experts' ranks and back by all-to-all (megatier.parallel.expert_dispatch),
inside the tensor-parallel region below (each tp rank exchanges with the same tp rank of the other ep ranks).

Tensor parallelism: the experts see every token (under sequence parallelism the token slices are gathered
first); each tp rank computes its slice of every expert's hidden units, and the weighted partial outputs are
summed over tp once (all-reduce, or reduce-scatter back to token slices). The routing weights enter that region
like an input (their gradient is summed over tp on the way back).

Router losses (:func:`router_losses`), ``model.moe.router_loss_scope``:

- "model", over the MoE layers of a forward together (transformers' ``load_balancing_loss_func``): aux =
  E * sum_e f_e * P_e, f_e the top-k slots expert e got per token and P_e its mean probability; z-loss = mean
  over tokens of logsumexp(logits)^2 (ST-MoE).
- "layer", each MoE layer on its own tokens, summed over the layers (Megatron-core's ``aux_loss``): aux_l =
  E / k * sum_e f_e * P_e (Megatron's 1/top_k makes a perfectly balanced router's loss 1 per layer), z_l as
  above. The losses of a stage's layers need nothing from the other stages, so pipeline stages each add their
  own to their backward (megatier.parallel.schedules).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatier.config import ModelConfig
from megatier.config.schema import expert_ffn_size
from megatier.parallel.expert_dispatch import dispatch_to_experts, local_experts
from megatier.parallel.layers import mark_partition
from megatier.parallel.mappings import (
    copy_to_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
)


@dataclass
class RouterStats:
    """What one MoE layer's forward leaves for the router losses and the metrics (this rank's tokens)."""

    slots_per_expert: torch.Tensor  # (E,) top-k slots each expert got, no gradient
    prob_sum: torch.Tensor  # (E,) sum over tokens of each expert's router probability
    z_sum: torch.Tensor  # () sum over tokens of logsumexp(logits)^2
    tokens: int


class _Weight(nn.Module):
    """A holder of one weight, so an expert's tensors are named like a linear's (``gate_up.weight``)."""

    def __init__(self, rows: int, cols: int, tp_dim, stride: int = 1, sequence_parallel: bool = False):
        super().__init__()
        self.weight = mark_partition(nn.Parameter(torch.empty(rows, cols)), tp_dim, stride)
        if sequence_parallel:  # applied to this rank's tokens: its gradient is a partial sum over tp
            self.weight.sequence_parallel = True


class ExpertMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) on this tp rank's hidden units: (n, h) -> (n, h), a partial sum over tp."""

    def __init__(self, hidden_size: int, ffn: int, tp: int):
        super().__init__()
        self.gate_up = _Weight(2 * ffn // tp, hidden_size, 0, stride=2)
        self.proj = _Weight(hidden_size, ffn // tp, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up.weight).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.proj.weight)


class Router(nn.Module):
    """Token -> its top-k experts and their weights, and the statistics of the router losses."""

    def __init__(self, cfg: ModelConfig, sequence_parallel: bool):
        super().__init__()
        self.top_k = cfg.moe.top_k
        self.renormalize = cfg.moe.router_norm == "topk_softmax" or cfg.moe.router_renormalize
        self.weight = mark_partition(nn.Parameter(torch.empty(cfg.moe.num_experts, cfg.hidden_size)), None)
        if sequence_parallel:  # applied to this rank's tokens: its gradient is a partial sum over tp
            self.weight.sequence_parallel = True

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, RouterStats]:
        """tokens (n, h) -> weights (n, k) in the tokens' dtype, expert ids (n, k), RouterStats."""
        logits = F.linear(tokens, self.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        slots = torch.bincount(expert_ids.flatten(), minlength=probs.shape[-1]).float()
        z_sum = torch.logsumexp(logits.float(), dim=-1).square().sum()
        return weights.to(tokens.dtype), expert_ids, RouterStats(slots, probs.sum(dim=0), z_sum, tokens.shape[0])


class Experts(nn.Module):
    """The routed experts this rank holds (all of them, or its ep rank's share under ``parallel.ep``), named by
    their global index (``experts.<e>.``) in every layout, and their dropless computation
    (megatier.parallel.expert_dispatch)."""

    def __init__(self, cfg: ModelConfig, tp: int, ep_group: dist.ProcessGroup | None = None):
        super().__init__()
        self.num_experts, self.ep_group = cfg.moe.num_experts, ep_group
        ep, ep_rank = (dist.get_world_size(ep_group), dist.get_rank(ep_group)) if ep_group is not None else (1, 0)
        for e in local_experts(self.num_experts, ep, ep_rank):
            expert = ExpertMLP(cfg.hidden_size, expert_ffn_size(cfg), tp)
            for param in expert.parameters():
                param.expert_index = e  # its own region of the flat buffer (megatier.optim.flat.FlatLayout)
            self.add_module(str(e), expert)

    def __getitem__(self, e: int) -> ExpertMLP:
        """Global expert ``e`` (one this rank holds)."""
        return self._modules[str(e)]

    def __iter__(self):
        return iter(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def forward(self, tokens: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """tokens (n, h), expert_ids and weights (n, k) -> sum over k of weight * expert(token), (n, h)."""
        return dispatch_to_experts(tokens, expert_ids, weights, lambda e, x: self[e](x), self.num_experts,
                                   self.ep_group)


class MoELayer(nn.Module):
    """The MLP of a mixture-of-experts layer: (b, s, h) -> (b, s, h) (this rank's tokens (b, s/tp, h) under
    sequence parallelism). Leaves its RouterStats in ``route_stats`` for the stage's router losses."""

    def __init__(self, cfg: ModelConfig, group: dist.ProcessGroup, sequence_parallel: bool = False,
                 ep_group: dist.ProcessGroup | None = None):
        super().__init__()
        tp = dist.get_world_size(group)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.router = Router(cfg, sequence_parallel)
        self.experts = Experts(cfg, tp, ep_group)
        self.shared = None
        if cfg.moe.shared_expert_hidden_size:
            self.shared = ExpertMLP(cfg.hidden_size, cfg.moe.shared_expert_hidden_size, tp)
            self.shared_gate = _Weight(1, cfg.hidden_size, None, sequence_parallel=sequence_parallel)
        self.route_stats: RouterStats | None = None

    def _to_all_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Into the tensor-parallel region: every token on every rank; the gradient summed over tp."""
        return gather_from_sequence(x, self.group) if self.sequence_parallel else copy_to_region(x, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        weights, expert_ids, self.route_stats = self.router(x.reshape(-1, h))
        tokens = self._to_all_tokens(x).reshape(-1, h)
        weights = self._to_all_tokens(weights.view(b, s, -1)).reshape(-1, weights.shape[-1])
        if self.sequence_parallel:
            with torch.no_grad():
                expert_ids = gather_from_sequence(expert_ids.view(b, s, -1), self.group)
        out = self.experts(tokens, expert_ids.reshape(-1, weights.shape[-1]), weights)
        if self.shared is not None:
            gate = self._to_all_tokens(torch.sigmoid(F.linear(x, self.shared_gate.weight))).reshape(-1, 1)
            out = out + gate * self.shared(tokens)
        out = out.view(b, -1, h)
        return reduce_scatter_to_sequence(out, self.group) if self.sequence_parallel else \
            reduce_from_region(out, self.group)


def _over_tp(x: torch.Tensor, group: dist.ProcessGroup, sequence_parallel: bool) -> torch.Tensor:
    """A sum over this rank's tokens made the sum over all tokens: under sequence parallelism each rank has its
    slice (summed forward; the gradient goes back as it is, each rank's share of the loss being its tokens')."""
    return reduce_from_region(x, group) if sequence_parallel else x


def router_losses(layers: list[MoELayer], cfg: ModelConfig, group: dist.ProcessGroup, sequence_parallel: bool,
                  metrics: RouterMetrics | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux, z) of the last forward of ``layers`` (model.moe.router_loss_scope; the module docstring), each a
    scalar, the same on every tp rank; added to ``metrics`` if given."""
    stats = [layer.route_stats for layer in layers]
    tokens = stats[0].tokens * (dist.get_world_size(group) if sequence_parallel else 1)
    slots = _over_tp(torch.stack([st.slots_per_expert for st in stats]), group, sequence_parallel)  # (layers, E)
    if cfg.moe.router_loss_scope == "layer":
        prob_sum = _over_tp(torch.stack([st.prob_sum for st in stats]), group, sequence_parallel)  # (layers, E)
        z_sum = _over_tp(torch.stack([st.z_sum for st in stats]), group, sequence_parallel)  # (layers,)
        balance = (slots * prob_sum).sum(dim=1) / (cfg.moe.top_k * tokens * tokens)
        aux, z = cfg.moe.num_experts * balance.sum(), (z_sum / tokens).sum()
    else:
        rows = tokens * len(stats)
        prob_sum = _over_tp(torch.stack([st.prob_sum for st in stats]).sum(0), group, sequence_parallel)
        z = _over_tp(torch.stack([st.z_sum for st in stats]).sum(), group, sequence_parallel) / rows
        aux = cfg.moe.num_experts * torch.sum((slots.sum(0) / rows) * (prob_sum / rows))
    if metrics is not None:
        metrics.add(aux, z, slots)
    return aux, z


class RouterMetrics:
    """A step's router figures for its metrics record, gathered over its training forwards (a stage's MoE
    layers, every micro-batch): the mean aux and z-loss per forward, the top-k slots each expert got per MoE
    layer and micro-batch (min and max over the experts; all tokens of a tp group under sequence parallelism),
    and the tokens dropped (0: routing is dropless). Under pipeline parallelism each stage holds its own
    layers' share: :meth:`take` sums the stages' losses (router_loss_scope=layer) and pools their slots."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self._losses: list[torch.Tensor] = []
        self._slots: list[torch.Tensor] = []

    def add(self, aux: torch.Tensor, z: torch.Tensor, slots_per_expert: torch.Tensor) -> None:
        """One forward: its losses and its MoE layers' slots per expert (layers, E), all without gradients."""
        self._losses.append(torch.stack([aux.detach(), z.detach()]).float())
        self._slots.append(slots_per_expert.detach())

    def take(self, pp_group: dist.ProcessGroup | None = None) -> dict[str, float]:
        """The figures since the last take (none: {}), then start over; with ``pp_group`` (collective over the
        pipeline stages, each calling it once a step) those of every stage."""
        pooled = torch.zeros(3 + self.num_experts, dtype=torch.float64)  # aux, z, slot rows, slots per expert
        if self._losses:
            slots = torch.cat(self._slots).double()
            pooled[:2] = torch.stack(self._losses).double().mean(0)
            pooled[2], pooled[3:] = slots.shape[0], slots.sum(0)
        self._losses, self._slots = [], []
        if pp_group is not None:
            dist.all_reduce(pooled, group=pp_group)
        if pooled[2] == 0:
            return {}
        per_expert = pooled[3:] / pooled[2]
        return {"moe_aux_loss": pooled[0].item(), "moe_z_loss": pooled[1].item(),
                "moe_tokens_per_expert_min": per_expert.min().item(),
                "moe_tokens_per_expert_max": per_expert.max().item(), "moe_dropped_tokens": 0}


def moe_layers(layers: nn.ModuleDict) -> list[MoELayer]:
    """The MoE layers among a stage's blocks, in order."""
    return [block.moe for block in layers.values() if isinstance(getattr(block, "moe", None), MoELayer)]
