"""Whether a unit's values are finite: a NaN or an inf in a base or a diff makes it a poisoned recovery point.

A checksum proves that bytes are the ones written, not that they are a state worth restoring: a base written
from a corrupted shard, or one whose bytes were planted with a valid checksum, loads cleanly and turns the loss
NaN a few steps later, and a job that restores it again after the crash loops (Megatron-LM issue 5281). So a
base is checked before the save thread hands it on (:mod:`megatier.checkpoint.save.worker`: a non-finite one
is never stored, and the run stops with :class:`NonFiniteState`), and every base and diff batch restore decodes
is checked too (:mod:`.payload`: a non-finite one is a corrupt copy, and the cascade takes another copy or an
older point).

The test is one summation per tensor, a pass at memory speed (a NaN or an inf makes the sum non-finite); only
a non-finite sum, which finite values of a huge magnitude can also give, is checked element by element.
"""
from __future__ import annotations

from typing import Mapping

import torch


class NonFiniteState(RuntimeError):
    """A rank's training state holds a NaN or an inf where it was about to be checkpointed."""


def nonfinite(tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """The names of the floating-point tensors among ``tensors`` that hold a NaN or an inf, in their order."""
    bad = []
    for name, t in tensors.items():
        if not t.is_floating_point() or t.is_meta or not t.numel():
            continue
        if torch.isfinite(t.sum(dtype=torch.float32)) or bool(torch.isfinite(t).all()):
            continue
        bad.append(name)
    return bad
