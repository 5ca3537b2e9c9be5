"""Bit-exact fingerprints of training state, for comparing runs."""
from __future__ import annotations

import torch
import torch.distributed as dist
import xxhash

from megatier.optim.canonical import ShardState, assemble, canonical_digest, shard_pieces


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


def gathered_canonical_digest(shard: ShardState, group: dist.ProcessGroup) -> str:
    """:func:`~megatier.optim.canonical.canonical_digest` of the whole job's state, the same under every layout.

    Every rank's pieces go to the group's first rank, which assembles the full unpadded state and hashes it;
    the digest comes back to every rank. Memory on that rank: the full optimizer state once (12 bytes per
    parameter), so this is for the end of a run, not for every step.
    """
    pieces = shard_pieces(shard)
    first = dist.get_global_rank(group, 0) if group is not None else 0
    gathered: list = [None] * dist.get_world_size(group) if dist.get_rank() == first else None
    dist.gather_object(pieces, gathered, dst=first, group=group)
    result = [canonical_digest(assemble([p for ps in gathered for p in ps]))] if gathered is not None else [None]
    dist.broadcast_object_list(result, src=first, group=group)
    return result[0]


def optimizer_state_digest(optimizer, step: int, group: dist.ProcessGroup) -> str:
    """xxh64 over every rank's full training state (the ZeRO shard of ``optimizer`` at ``step``), combined in
    rank order over ``group``."""
    local = shard_digest(optimizer.state_tensors(), {"step": step, "adam_steps": optimizer.adam_steps})
    return combined_digest(local, group)


def optimizer_canonical_digest(optimizer, tp_rank: int, tp: int, group: dist.ProcessGroup) -> str:
    """xxh64 of the job's optimizer state by parameter name, unpadded: equal for equal state under any layout
    (:mod:`megatier.optim.canonical`)."""
    tensors = {k: t.detach().cpu() for k, t in optimizer.state_tensors().items()}
    return gathered_canonical_digest(ShardState(tp_rank, tp, optimizer.shard_segments, tensors), group)
