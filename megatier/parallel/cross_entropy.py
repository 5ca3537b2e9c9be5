"""Cross entropy over logits whose vocabulary dimension is cut across tensor-parallel ranks.

Each rank holds logits (..., V/tp) for its vocabulary slice. The softmax
denominator, the max and the target logit are combined with three small
all-reduces, so the full (..., V) logits are never materialised.

Vocabulary padding: ``mask_padded_vocab`` sets the logits of ids at or past
the true vocabulary to -inf before the loss. exp(-inf) = 0, so padded ids
have exactly zero probability and get exactly zero gradient on every tp; a
rank whose whole slice is padding is fine as long as the global max is
finite (the true vocabulary is never empty).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        # logits (..., V/tp) in any float dtype; the math runs in fp32.
        logits = logits.float()
        logits_max = logits.max(dim=-1).values
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - logits_max.unsqueeze(-1)

        per_rank = logits.shape[-1]
        local = target - vocab_start
        outside = (local < 0) | (local >= per_rank)
        local = local.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        dist.all_reduce(target_logit, group=group)

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)
        loss = sum_exp.log() - target_logit

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, outside = ctx.saved_tensors
        # d loss / d logits = softmax - onehot(target), onehot only on the owning rank.
        grad = softmax.clone()
        grad.scatter_add_(-1, local.unsqueeze(-1), (~outside).to(grad.dtype).neg().unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None


def mask_padded_vocab(logits: torch.Tensor, *, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """Logits (..., V/tp) of ids [vocab_start, vocab_start + V/tp) with -inf where the id >= ``vocab_size``."""
    per_rank = logits.shape[-1]
    first_padded = min(max(vocab_size - vocab_start, 0), per_rank)  # local column of the first padded id
    if first_padded == per_rank:
        return logits
    padded = torch.arange(per_rank, device=logits.device) >= first_padded  # (V/tp,)
    return logits.masked_fill(padded, float("-inf"))  # backward: zero gradient in the padded columns


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, vocab_start: int,
                                 group: dist.ProcessGroup) -> torch.Tensor:
    """Per-token loss (...,) from vocab-parallel logits (..., V/tp) and global target ids (...)."""
    if dist.get_world_size(group) == 1:
        return F.cross_entropy(logits.float().flatten(0, -2), target.flatten(), reduction="none").view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, group)
