"""A training job moved between frameworks: what every format's import gives and every export takes.

A job is more than its weights: :class:`JobState` is the canonical state (MegaTier name -> kind -> full,
unpadded fp32 tensor, kinds ``master``, ``exp_avg``, ``exp_avg_sq``, as :mod:`megatier.optim.canonical`
assembles it), the iteration the state is at, Adam's bias-correction count, where the data was (samples or
tokens, what the source records) and the learning rate the source would take next. ``notes`` says, one line
each, what did not carry over (another optimizer, an RNG, a data loader's own state).

``model.init_from`` names a source: a plain path is a Hugging Face directory (weights only); a
``<format>:<path>`` one of :data:`JOB_FORMATS`, a whole job (:func:`split_init_from`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

import torch

from megatier.config import ModelConfig
from megatier.model.params import canonical_shapes

JOB_FORMATS = ("torchtitan", "torch_dist", "megatron_legacy")
KINDS = ("master", "exp_avg", "exp_avg_sq")


class JobFormatError(ValueError):
    """A checkpoint MegaTier cannot continue: one line naming the key or file and the fix."""


@dataclass
class JobState:
    canonical: dict[str, dict[str, torch.Tensor]]
    iteration: int
    adam_steps: int
    consumed_samples: Optional[int] = None
    consumed_tokens: Optional[int] = None
    next_lr: Optional[float] = None  # the rate the source's next step would take, where it records one
    source: str = ""
    notes: list[str] = field(default_factory=list)


def split_init_from(value: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """(format, path) of a ``model.init_from`` value: (None, path) for a Hugging Face directory."""
    if value is None:
        return None, None
    match = re.fullmatch(r"([a-z_]+):(.+)", value)
    if match and match.group(1) in JOB_FORMATS:
        return match.group(1), match.group(2)
    return None, value


def check_model(fmt: str, m: ModelConfig, arch: str) -> None:
    """Refuse a model.arch the format's checkpoints do not hold."""
    if m.arch != arch:
        raise JobFormatError(f"{fmt} checkpoints hold a {arch} model but model.arch={m.arch}; {fmt} moves "
                             f"model.arch={arch} jobs only")
    check_no_qkv_bias(fmt, m)


def check_no_qkv_bias(fmt: str, m: ModelConfig) -> None:
    """Refuse q/k/v biases (Qwen2's), which no job format's mapping carries: they would be dropped."""
    if m.qkv_bias:
        raise JobFormatError(f"model.qkv_bias=true: MegaTier's {fmt} mapping has no q/k/v bias keys, so the "
                             f"biases would be lost; move this model's weights as Hugging Face Qwen2 "
                             f"(megatier-convert export --format hf)")


def check_shapes(state: dict[str, dict[str, torch.Tensor]], m: ModelConfig, vocab: int, where: str) -> None:
    """Every canonical name present with the model's full shape, for every kind."""
    expected = canonical_shapes(m, vocab)
    missing = sorted(expected.keys() - state.keys())
    if missing:
        raise JobFormatError(f"{where} has no tensor for MegaTier's {missing[0]} ({len(missing)} missing); the "
                             f"checkpoint holds another model than model.* describes")
    for name, shape in expected.items():
        for kind, value in state[name].items():
            if tuple(value.shape) != shape:
                raise JobFormatError(f"{where}: {name} ({kind}) has shape {tuple(value.shape)} where model.* "
                                     f"implies {shape}; set model.* to the checkpoint's shape")


def zero_moments(state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Weights alone as a canonical state with Adam's moments at zero (a source without an optimizer)."""
    return {n: {"master": w, "exp_avg": torch.zeros_like(w), "exp_avg_sq": torch.zeros_like(w)}
            for n, w in state.items()}


def as_fp32(value: torch.Tensor, what: str, notes: list[str]) -> torch.Tensor:
    """``value`` in fp32; a narrower source dtype is said once (the state is then exact only to that dtype)."""
    if value.dtype != torch.float32:
        line = f"{what} are {str(value.dtype).replace('torch.', '')}: widened to fp32"
        if line not in notes:
            notes.append(line)
    return value.detach().to(torch.float32).contiguous()


def schedule_notes(job: JobState, lr: Optional[float], samples: Optional[int]) -> list[str]:
    """Where MegaTier's schedule and data position, as configured, differ from the source's at its next step."""
    out = []
    if job.next_lr is not None and lr is not None and abs(job.next_lr - lr) > 1e-12 * max(1.0, abs(lr)):
        out.append(f"learning rate: the source's next step takes {job.next_lr:.6g}, MegaTier's optim.* schedule "
                   f"{lr:.6g} at step {job.iteration + 1}; set optim.* to the source's schedule to continue it")
    if job.consumed_samples is not None and samples is not None and job.consumed_samples != samples:
        out.append(f"data: the source consumed {job.consumed_samples} samples, MegaTier's batches give "
                   f"{samples} by step {job.iteration}; the data position follows MegaTier's train.* settings")
    return out
