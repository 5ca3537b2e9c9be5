"""Activation recomputation (``model.recompute``) that draws the same random numbers again.

A recomputed region keeps only its inputs; the backward runs it again to rebuild what it needs. Its dropout
masks must come out the same: the global RNG is put back by ``torch.utils.checkpoint``
(``preserve_rng_state``), and the model's own dropout generators (:class:`~megatier.model.gpt.HiddenDropout`)
here, set to their state at the first run for the re-run and restored afterwards, so the rest of the step
(later micro-batches of a pipeline schedule) draws what it would have drawn without recomputation.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint


def recomputed(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor,
               generators: Sequence[torch.Generator] = ()) -> torch.Tensor:
    """``fn(*inputs)``, its activations recomputed in the backward instead of kept."""
    states = [g.get_state() for g in generators]
    first_run = [True]

    def run(*args: torch.Tensor) -> torch.Tensor:
        if first_run[0]:
            first_run[0] = False
            return fn(*args)
        live = [g.get_state() for g in generators]
        for g, state in zip(generators, states):
            g.set_state(state)
        try:
            return fn(*args)
        finally:
            for g, state in zip(generators, live):
                g.set_state(state)

    return checkpoint(run, *inputs, use_reentrant=False, preserve_rng_state=True)
