"""What the tests that train MegaTier beside a Hugging Face model share: the job (fp32, AdamW with Megatron's
schedule, clipping and weight decay) and the reference loop, torch.optim.AdamW over the same batches with
Megatron's weight-decay grouping (matrices and embeddings decay, norms do not)."""
from __future__ import annotations

from typing import Callable

import torch

from megatier.optim.schedule import LRSchedule
from tests.distributed.configs import tiny_job

STEPS = 20


def hf_job(tmp: str, name: str, prefix: str, hf_dir: str, tp: int, model: dict):
    """The job of ``model`` started from ``hf_dir`` at tp (sequence parallelism with it)."""
    return tiny_job(tmp, f"{name}-tp{tp}", prefix, iters=STEPS, tp=tp, sequence_parallel=tp > 1, run=f"run-tp{tp}",
                    model={**model, "init_from": hf_dir},
                    optim={"lr": 3e-3, "min_lr": 3e-4, "warmup_iters": 4, "decay_iters": STEPS, "clip_grad": 0.5,
                           "weight_decay": 0.1})


def adamw_losses(model: torch.nn.Module, batches, o, loss_of: Callable) -> list[float]:
    """``model`` trained on ``batches`` (per step, its micro-batches) by AdamW under the job's optimizer config
    ``o``; ``loss_of(model, x, y)`` is one micro-batch's objective. Each step's mean loss."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    schedule = LRSchedule(o.lr, o.min_lr, o.warmup_iters, o.decay_iters)
    losses = []
    for step, mbs in enumerate(batches, start=1):
        opt.zero_grad()
        loss = sum(loss_of(model, x, y) for x, y in mbs)
        (loss / len(mbs)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad)
        for group in opt.param_groups:
            group["lr"] = schedule(step)
        opt.step()
        losses.append(float(loss) / len(mbs))
    return losses
