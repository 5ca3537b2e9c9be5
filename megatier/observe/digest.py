"""Bit-exact fingerprints of training state, for comparing runs."""
from __future__ import annotations

import torch
import torch.distributed as dist
import xxhash


def shard_digest(tensors: dict[str, torch.Tensor], scalars: dict[str, int]) -> str:
    """xxh64 over the raw bytes of ``tensors`` (in key order) and the integer ``scalars``."""
    h = xxhash.xxh64()
    for key in sorted(tensors):
        t = tensors[key].detach().contiguous().cpu()
        h.update(key.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    for key in sorted(scalars):
        h.update(f"{key}={int(scalars[key])};".encode())
    return h.hexdigest()


def combined_digest(local: str, group: dist.ProcessGroup) -> str:
    """Gather every rank's digest and hash them in rank order; the same value on all ranks."""
    digests: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(digests, local, group=group)
    return xxhash.xxh64("".join(digests).encode()).hexdigest()
