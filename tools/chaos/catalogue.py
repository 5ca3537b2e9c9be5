"""Every fault type the campaign injects: what it does before, during and after one launch of the job.

A launch runs the job from its recovery point until a *carrier* kills it at a
chosen step (``train.step_end`` on the victim node, or on every node), so every
fault is followed by a relaunch that must recover. On top of the carrier a fault
arms a crash point, damages a tier before the launch, disturbs Tier-3 or a
process during it, plants a transient fault into one step (which the step's
rerun must catch), or wipes node memory after it. A recurring fault crashes
the same step in ``reliability.loop_limit`` launches in a row: the restart-loop
guard must take an older point rather than restore into it again.
"""
from __future__ import annotations

import glob
import json
import os
import random
import shutil
from dataclasses import dataclass, field
from typing import Callable, Optional

from tools.chaos.s3_proxy import FaultRule


@dataclass(frozen=True)
class FaultType:
    name: str
    what: str
    crash_point: Optional[str] = None  # armed on every node at the launch's step (replay.mid_batch: at 0)
    carrier_everywhere: bool = False  # the carrier kills every node (a rack stop), not only the victim
    wipe: Optional[str] = None  # after the launch: "node" (the victim's memory) or "rack" (every node's)
    damage: Optional[Callable[["Damage"], Optional[str]]] = None  # before the launch; returns what it did
    s3: Optional[Callable[[int], FaultRule]] = None  # the proxy's rule during the launch (victim rank given)
    hang: bool = False  # SIGSTOP one process of the victim node once the job passes the launch's step
    file_limit: Optional[int] = None  # bytes: the victim node's disk is "full" for larger files
    lease_conflict: bool = False  # a second launch of the job while this one runs
    needs_s3: bool = False
    transient: Optional[str] = None  # the env var of a one-step transient fault armed on the victim's first rank
    recurring: bool = False  # the launch's step crashes as it begins, in reliability.loop_limit launches in a row


@dataclass
class Damage:
    """What a damaging fault may touch: the node memory root, the Tier-3 store, the victim and a seeded RNG."""

    tier1_job_dir: str
    store: object  # ObjectStore of the job's Tier-3 prefix
    victim_node: str
    rng: random.Random
    notes: list[str] = field(default_factory=list)


def _payloads(pattern: str) -> list[str]:
    return sorted(glob.glob(pattern))


def _flip(path: str, rng: random.Random) -> None:
    with open(path, "r+b") as f:
        size = os.path.getsize(path)
        f.seek(rng.randrange(max(1, size)))
        byte = f.read(1) or b"\0"
        f.seek(-len(byte), os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _node_payload(d: Damage, area: str) -> Optional[str]:
    files = _payloads(os.path.join(d.tier1_job_dir, d.victim_node, area, "*", "base", "*.safetensors"))
    return files[-1] if files else None


def t1_flip(d: Damage) -> Optional[str]:
    path = _node_payload(d, "own")
    if path:
        _flip(path, d.rng)
    return path


def t1_truncate(d: Damage) -> Optional[str]:
    path = _node_payload(d, "own")
    if path:
        os.truncate(path, os.path.getsize(path) // 2)
    return path


def t2_flip(d: Damage) -> Optional[str]:
    path = _node_payload(d, "replica")
    if path:
        _flip(path, d.rng)
    return path


def _committed_object(d: Damage) -> Optional[str]:
    keys = [k for k in d.store.list("base/") if k.endswith(".safetensors")]
    return max(keys) if keys else None


def t3_flip(d: Damage) -> Optional[str]:
    key = _committed_object(d)
    if key:
        data = bytearray(d.store.get(key))
        data[d.rng.randrange(len(data))] ^= 0xFF
        d.store.put(key, bytes(data))
    return key


def t3_truncate(d: Damage) -> Optional[str]:
    key = _committed_object(d)
    if key:
        data = d.store.get(key)
        d.store.put(key, data[: len(data) // 2])
    return key


def t3_lost(d: Damage) -> Optional[str]:
    key = _committed_object(d)
    if key:
        d.store.delete(key)
    return key


def commit_record_corrupt(d: Damage) -> Optional[str]:
    keys = sorted(k for k in d.store.list("diff/") if k.endswith("/_COMMITTED"))
    if not keys:
        return None
    key = keys[0]  # the oldest committed batch: its record becomes unreadable
    d.store.put(key, b"{not json")
    return key


def stale_area(d: Damage) -> Optional[str]:
    """A stale area of an earlier run that used this job id with another config: a newer-looking base whose
    stamp names another fingerprint, which restore must set aside (and then discard, being past E)."""
    stamps = _payloads(os.path.join(d.tier1_job_dir, d.victim_node, "own", "*", "base", "*.json"))
    if not stamps:
        return None
    with open(stamps[-1]) as f:
        stamp = json.load(f)
    version = int(stamp["last"]) + 1000
    stamp.update(first=version, last=version, fingerprint="0123456789abcdef")
    dest = os.path.join(os.path.dirname(stamps[-1]), f"v{version:08d}")
    shutil.copy(stamps[-1].replace(".json", ".safetensors"), dest + ".safetensors")
    with open(dest + ".json", "w") as f:
        json.dump(stamp, f)
    return dest + ".json"


def t1_nan_base(d: Damage) -> Optional[str]:
    """The Megatron-LM 5281 case: a NaN in the master weights of a rank's newest node-memory base, stamped with
    its own valid checksum, so the copy loads cleanly. Restore must find it poisoned and take another copy."""
    import dataclasses

    import safetensors.torch

    from megatier.checkpoint.format.payload import EncodedPayload, checksum, read_metadata
    from megatier.checkpoint.format.units import BASE
    from megatier.checkpoint.tiers.node_memory import NodeMemory

    root, job_id = os.path.split(d.tier1_job_dir.rstrip("/"))
    memory = NodeMemory(root, job_id, d.victim_node)
    bases = [e for e in memory.entries() if e.complete and e.pid.kind == BASE]
    if not bases:
        return None
    newest = max(bases, key=lambda e: (e.pid.version, -e.owner_rank))
    payload = memory.load(newest.owner_rank, newest.pid)
    tensors = safetensors.torch.load(payload.data)
    tensors["master"][d.rng.randrange(tensors["master"].numel())] = float("nan")
    meta = json.dumps(read_metadata(payload.data, "campaign"))
    data = safetensors.torch.save(tensors, metadata={"megatier": meta})
    memory.save(EncodedPayload(data, dataclasses.replace(payload.stamp, size=len(data), xxh64=checksum(data))))
    return f"{d.victim_node} rank {newest.owner_rank} {newest.pid} (NaN under a valid checksum)"


def _crash(point: str) -> FaultType:
    return FaultType(f"crash {point}", f"SIGKILL at the {point} crash point", crash_point=point)


CATALOGUE: dict[str, FaultType] = {f.name: f for f in [
    _crash("t1.mid_write"), _crash("t2.mid_chunk"), _crash("t2.mid_record"), _crash("t3.before_marker"),
    _crash("t3.before_commit"),
    _crash("t3.after_commit_before_watermark"), _crash("gc.mid_delete"), _crash("replay.mid_batch"),
    FaultType("software", "SIGKILL of one node's processes after a step"),
    FaultType("node", "a node lost: its processes killed and its memory wiped", wipe="node"),
    FaultType("rack", "every node lost: all processes killed, all node memory wiped", carrier_everywhere=True,
              wipe="rack"),
    FaultType("hang", "one process SIGSTOPped: the others must fail within the timeout", hang=True),
    FaultType("t1 flip", "a flipped byte in a node-memory base", damage=t1_flip),
    FaultType("t1 truncate", "a node-memory base cut in half", damage=t1_truncate),
    FaultType("t2 flip", "a flipped byte in a replica base", damage=t2_flip),
    FaultType("t3 flip", "a flipped byte in a committed Tier-3 base", damage=t3_flip),
    FaultType("t3 truncate", "a committed Tier-3 base cut in half", damage=t3_truncate),
    FaultType("t3 lost", "a committed Tier-3 object deleted", damage=t3_lost),
    FaultType("commit record", "an unreadable _COMMITTED record", damage=commit_record_corrupt),
    FaultType("stale area", "another job's copies planted in node memory", damage=stale_area),
    FaultType("nan base", "a NaN in a node-memory base's master weights under a valid checksum",
              damage=t1_nan_base),
    FaultType("grad nan", "a NaN planted into one rank's gradient at one step (transient)",
              transient="MEGATIER_GRAD_NAN_AT"),
    FaultType("activation flip", "a bit flipped in one rank's activation at one step (transient)",
              transient="MEGATIER_FLIP_AT"),
    FaultType("crash after restore", "a step that crashes whenever it is reached, in launch after launch",
              recurring=True),
    FaultType("t1 full", "the victim node's disk full for anything over 64 KiB", file_limit=64 << 10),
    FaultType("lease", "a second launch of the job while it runs", lease_conflict=True),
    FaultType("s3 slowdown", "Tier-3 answers half of all requests 503 SlowDown", needs_s3=True,
              s3=lambda rank: FaultRule("slowdown", None, 0.5)),
    FaultType("s3 500 one rank", "Tier-3 answers every request for one rank's objects 500", needs_s3=True,
              s3=lambda rank: FaultRule("error500", rank, 1.0)),
    FaultType("s3 resets", "Tier-3 drops 30% of connections unanswered", needs_s3=True,
              s3=lambda rank: FaultRule("reset", None, 0.3)),
    FaultType("s3 full", "Tier-3 refuses every write 507 (storage full)", needs_s3=True,
              s3=lambda rank: FaultRule("full", None, 1.0)),
]}
