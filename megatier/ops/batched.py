"""A whole shard's compression in one fixed sequence of tensor ops, with no host synchronisation: the GPU's
path (on a CPU the compiled kernel, or the segment-by-segment definition, is faster).

The compiled CPU kernel codes a shard segment by segment and decides on the host, chunk by chunk, whether
the sampled top-k threshold kept a count in ``[k / 2, 2 k]`` or must be made exact. On a GPU every such
decision is a device-to-host sync (about 50 a step for GPT-2 small). Here every decision stays on the
device: all top-k chunks of the shard are coded together (a chunk id per element selects its threshold),
the exact radix select is computed for every chunk and used where the sampled threshold failed, and the
kept entries are scattered into per-chunk slots of their largest possible size (``min(n, 2 k)``), with the
counts in a device tensor. The only host work is planning from the segment sizes and the seed.

:class:`PendingRecord` then packs the pools and counts into one buffer and copies it to pinned host memory
on a side stream; the record is built when :meth:`PendingRecord.wait` is called. The records are bitwise
those of the CPU kernel and of :func:`megatier.ops.reference.compress_pools` (the definition).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from megatier.ops import reference
from megatier.ops.records import POOLS

_NO_KEY = 0x7FFFFFFF  # the threshold of elements outside every top-k chunk (with no ties allowed: none kept)
_RADIX_LEVELS = ((20, 11), (8, 12), (0, 8))  # (shift, bits) of the key bits 30..20, 19..8, 7..0


@dataclass(frozen=True)
class _TopkPlan:
    """Host-side plan of a shard's top-k chunks (from the sizes and the seed; no data)."""

    starts: list[int]  # flat offset of each chunk
    sizes: list[int]
    targets: list[int]  # k of each chunk
    slots: list[int]  # slot start of each chunk in the padded pools (slots hold min(n, 2 k) entries)
    kinds: list[str]  # "all" (k >= n), "sampled" or "exact" (n <= sample_size)
    run_ids: list[int]  # chunk id of each run of flat (len(starts) for elements of other codecs)
    run_lengths: list[int]
    sample_runs: np.ndarray  # start of each sampled run (flat offset)
    sample_rows: np.ndarray  # its row among the sampled chunks
    sample_cols: np.ndarray  # its column (run number) in that row
    sample_ranks: list[int]  # per sampled chunk: which largest sample key is the threshold (1-based)

    @property
    def padded(self) -> int:
        return self.slots[-1] + min(self.sizes[-1], 2 * self.targets[-1]) if self.starts else 0


def _plan_topk(offsets: list[int], numels: list[int], codecs: list[str], h: dict) -> _TopkPlan:
    starts, sizes, targets, slots, kinds, run_ids, run_lengths = [], [], [], [], [], [], []
    runs, rows, cols, ranks = [], [], [], []
    other = sum(-(-num // h["chunk_size"]) for num, c in zip(numels, codecs) if c == "topk")
    slot = 0
    for s, (off, num, codec) in enumerate(zip(offsets, numels, codecs)):
        if codec != "topk":
            run_ids.append(other)
            run_lengths.append(num)
            continue
        for ci, lo in enumerate(range(0, num, h["chunk_size"])):
            n = min(h["chunk_size"], num - lo)
            k = reference.topk_target(n, h["ratio"])
            kind = "all" if k >= n else "sampled" if n > h["sample_size"] else "exact"
            if kind == "sampled":
                run = reference.sample_run_starts(n, reference.effective_sample_size(n, h["sample_size"]),
                                                  reference.chunk_seed(h["seed"], s, ci))
                sampled = int(np.minimum(n - run, reference.SAMPLE_RUN).sum())
                ranks.append(reference.topk_target(sampled, h["ratio"]))
                runs.append(off + lo + run)
                rows.append(np.full(run.size, len(ranks) - 1, dtype=np.int64))
                cols.append(np.arange(run.size, dtype=np.int64))
            run_ids.append(len(starts))
            run_lengths.append(n)
            starts.append(off + lo)
            sizes.append(n)
            targets.append(k)
            slots.append(slot)
            kinds.append(kind)
            slot += min(n, 2 * k)
    empty = np.zeros(0, dtype=np.int64)
    return _TopkPlan(starts, sizes, targets, slots, kinds, run_ids, run_lengths,
                     np.concatenate(runs) if runs else empty, np.concatenate(rows) if rows else empty,
                     np.concatenate(cols) if cols else empty, ranks)


def _on(device: torch.device, values, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A small host array on ``device`` without waiting for the device (pinned, non-blocking on a GPU)."""
    t = torch.as_tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _zero_led_cumsum(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[0, cumsum(mask)...]`` (one longer): ``out[b] - out[a]`` counts ``mask[a:b]``."""
    out = torch.zeros(mask.numel() + 1, dtype=dtype, device=mask.device)
    torch.cumsum(mask, 0, dtype=dtype, out=out[1:])
    return out


def _sampled_thresholds(keys: torch.Tensor, plan: _TopkPlan) -> torch.Tensor:
    """Per sampled chunk, the threshold key its sample gives (at least 1: exact zeros are never kept)."""
    dev = keys.device
    nrows = len(plan.sample_ranks)
    width = int(np.bincount(plan.sample_rows, minlength=nrows).max())
    runs = _on(dev, plan.sample_runs)
    pos = runs[:, None] + torch.arange(reference.SAMPLE_RUN, device=dev)
    chunk_end = _on(dev, [plan.starts[i] + plan.sizes[i] for i, k in enumerate(plan.kinds) if k == "sampled"])
    rows = _on(dev, plan.sample_rows)
    inside = pos < chunk_end[rows][:, None]
    sample = torch.where(inside, keys[pos.clamp_(max=keys.numel() - 1)], -1)  # -1 sorts below every key
    table = torch.full((nrows, width, reference.SAMPLE_RUN), -1, dtype=keys.dtype, device=dev)
    table[rows, _on(dev, plan.sample_cols)] = sample
    ordered = table.view(nrows, -1).sort(dim=1, descending=True).values
    rank = _on(dev, plan.sample_ranks) - 1
    return ordered.gather(1, rank[:, None]).view(-1).clamp_(min=1).to(torch.int64)


def _radix_select(keys: torch.Tensor, chunk_of: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
    """Per chunk, its ``targets``-th largest key and how many keys are strictly above it: three histogram
    levels over the key bits, as the CPU kernel's radix select, all chunks at once."""
    nchunks = targets.numel()
    prefix = torch.zeros(nchunks, dtype=torch.int64, device=keys.device)
    above = torch.zeros_like(prefix)
    remaining = targets.clone()
    for shift, bits in _RADIX_LEVELS:
        nb = 1 << bits
        under = ((keys >> (shift + bits)) == prefix.index_select(0, chunk_of)).to(torch.int32)  # under the prefix
        hist = torch.zeros(nchunks * nb, dtype=torch.int32, device=keys.device)
        hist.index_add_(0, chunk_of * nb + ((keys >> shift) & (nb - 1)), under)
        from_top = hist.view(nchunks, nb).flip(1).to(torch.int64)
        reached = from_top.cumsum(1)
        j = (reached < remaining[:, None]).sum(1).clamp_(max=nb - 1)[:, None]
        passed = (reached.gather(1, j) - from_top.gather(1, j)).view(-1)
        above += passed
        remaining -= passed
        prefix = (prefix << bits) | (nb - 1 - j.view(-1))
    return prefix, above


def _topk(flat: torch.Tensor, plan: _TopkPlan, feedback: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The padded top-k pools (values, indices) and per-chunk counts of every top-k chunk of ``flat``.

    Vectors indexed by chunk have one entry more, for the elements of other codecs (an empty chunk at the
    end of ``flat`` whose threshold keeps nothing). Per-element positions are int32 where the shard allows:
    the pass holds several shard-sized temporaries."""
    dev, n = flat.device, flat.numel()
    wide = torch.int32 if n < 2**31 - 1 else torch.int64
    all_ties = torch.iinfo(wide).max  # a tie allowance that keeps every element equal to the threshold
    keys = reference.magnitude_keys(flat)
    chunk_of = torch.repeat_interleave(_on(dev, plan.run_ids, torch.int32), _on(dev, plan.run_lengths),
                                       output_size=n)
    starts = _on(dev, plan.starts + [n], wide)
    ends = _on(dev, [s + z for s, z in zip(plan.starts, plan.sizes)] + [n], wide)
    targets = _on(dev, plan.targets + [1], wide)
    kind = {name: _on(dev, [k == name for k in plan.kinds] + [False], torch.bool)
            for name in ("all", "sampled", "exact")}

    threshold = torch.full((len(plan.starts) + 1,), _NO_KEY, dtype=wide, device=dev)
    threshold.masked_fill_(kind["all"], 1)
    exact = kind["exact"]
    if plan.sample_ranks:
        chosen = [i for i, k in enumerate(plan.kinds) if k == "sampled"]
        threshold.index_copy_(0, _on(dev, chosen), _sampled_thresholds(keys, plan).to(wide))
        count = _zero_led_cumsum(keys >= threshold.index_select(0, chunk_of), wide)
        counted = count[ends] - count[starts]
        del count
        fits = (2 * counted >= targets) & (counted <= 2 * targets)
        exact = exact | (kind["sampled"] & ~fits)
    kth, above = (t.to(wide) for t in _radix_select(keys, chunk_of, targets.to(torch.int64)))
    ties_kept = torch.where(kind["exact"] | kind["sampled"] | kind["all"], all_ties, 0).to(wide)
    threshold = torch.where(exact, kth.clamp(min=1), threshold)  # kth 0: fewer than k nonzeros, keep them all
    ties_kept = torch.where(exact & (kth > 0), targets - above, ties_kept)

    at = threshold.index_select(0, chunk_of)
    ties = keys == at
    tie_rank = _zero_led_cumsum(ties, wide)
    rank = tie_rank[1:] - tie_rank[starts].index_select(0, chunk_of)
    del tie_rank
    keep = (keys > at) | (ties & (rank <= ties_kept.index_select(0, chunk_of)))
    del at, ties, rank
    kept = _zero_led_cumsum(keep, wide)
    counts = (kept[ends] - kept[starts])[:-1].to(torch.int64)
    slots = _on(dev, plan.slots + [plan.padded], wide)
    slot = torch.where(keep, kept[1:] + (slots - kept[starts] - 1).index_select(0, chunk_of), plan.padded)
    del kept
    values = flat.new_empty(plan.padded + 1, dtype=torch.float16)
    indices = flat.new_empty(plan.padded + 1, dtype=torch.int32)
    halves = flat.to(torch.float16)
    values.scatter_(0, slot, halves)
    indices.scatter_(0, slot, (torch.arange(n, dtype=wide, device=dev) - starts.index_select(0, chunk_of)).to(
        torch.int32))
    if feedback:  # only kept entries change: what the record holds is taken out
        torch.where(keep, flat - halves.to(torch.float32), flat, out=flat)
    return values[:-1], indices[:-1], counts


def _int8(flat: torch.Tensor, offsets: list[int], numels: list[int], block_size: int,
          feedback: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales of every INT8 segment, each padded to whole blocks as the reference does."""
    dev = flat.device
    padded = [-(-num // block_size) * block_size for num in numels]
    bases = list(itertools.accumulate([0, *padded[:-1]]))
    total = sum(padded)
    seg = torch.repeat_interleave(torch.arange(len(numels), device=dev), _on(dev, padded), output_size=total)
    local = torch.arange(total, device=dev) - _on(dev, bases).index_select(0, seg)
    inside = local < _on(dev, numels).index_select(0, seg)
    src = (_on(dev, offsets).index_select(0, seg) + local).clamp_(max=max(flat.numel() - 1, 0))
    blocks = torch.where(inside, flat.index_select(0, src), 0.0).view(-1, block_size)
    codes, scales = reference.quantize_int8(blocks.view(-1), block_size)
    out_bases = list(itertools.accumulate([0, *numels[:-1]]))
    seg_out = torch.repeat_interleave(torch.arange(len(numels), device=dev), _on(dev, numels),
                                      output_size=sum(numels))
    shift = (_on(dev, bases) - _on(dev, out_bases)).index_select(0, seg_out)
    wanted = torch.arange(sum(numels), device=dev) + shift
    codes = codes.index_select(0, wanted)
    if feedback:
        decoded = codes.to(torch.float32) * scales.index_select(0, wanted // block_size)
        at = src.index_select(0, wanted)
        flat.index_put_((at,), flat.index_select(0, at) - decoded)
    return codes, scales


def compress_pools(flat: torch.Tensor, offsets: list[int], numels: list[int], codecs: list[str], h: dict,
                   feedback: bool) -> tuple[dict[str, torch.Tensor], Optional[torch.Tensor], _TopkPlan]:
    """The record's pools (top-k pools padded to per-chunk slots), the top-k counts on the device (``None``
    without top-k chunks) and the plan that places them; ``flat`` is left with the feedback if asked."""
    pools = {name: flat.new_empty(0, dtype=dtype) for name, dtype in POOLS.items()}
    plan = _plan_topk(offsets, numels, codecs, h)
    if set(codecs) <= {"bf16", "fp32"}:  # the lossless modes code every segment alike: the whole shard
        if codecs:
            name = f"{codecs[0]}_values"
            pools[name] = flat.to(POOLS[name], copy=True)
            if feedback:
                flat.sub_(pools[name].to(torch.float32))
        return pools, None, plan
    small = [(off, num) for off, num, codec in zip(offsets, numels, codecs) if codec == "int8"]
    counts = None
    if plan.starts:  # before INT8's feedback: the two never share an element
        pools["topk_values"], pools["topk_indices"], counts = _topk(flat, plan, feedback)
    if small:
        pools["int8_codes"], pools["int8_scales"] = _int8(flat, [o for o, _ in small], [k for _, k in small],
                                                          h["block_size"], feedback)
    return pools, counts, plan


def trim(pools: dict[str, torch.Tensor], counts: list[int], plan: _TopkPlan) -> dict[str, torch.Tensor]:
    """The pools with each top-k chunk's slot cut to its count (host tensors)."""
    if not plan.starts:
        return pools
    out = dict(pools)
    for name in ("topk_values", "topk_indices"):
        out[name] = torch.cat([pools[name][s : s + c] for s, c in zip(plan.slots, counts)])
    return out


class PendingRecord:
    """A record's pools and counts on their way to host memory: packed into one device buffer and copied to
    pinned memory on a side stream, after the work queued so far on the current stream. :meth:`wait` waits
    for that copy alone and returns ``(pools on the host, top-k counts)``."""

    def __init__(self, pools: dict[str, torch.Tensor], counts: Optional[torch.Tensor], plan: _TopkPlan):
        self.plan = plan
        dev = next(iter(pools.values())).device
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        parts = dict(pools, counts=empty if counts is None else counts)
        self._layout, offset = [], 0
        for name, t in parts.items():
            self._layout.append((name, t.dtype, t.numel(), offset))
            offset += -(-t.numel() * t.element_size() // 8) * 8  # every part 8-byte aligned
        packed = torch.empty(offset, dtype=torch.uint8, device=dev)
        for (_, _, _, at), t in zip(self._layout, parts.values()):
            raw = t.reshape(-1).view(torch.uint8)
            packed[at : at + raw.numel()].copy_(raw)
        self._host = torch.empty(offset, dtype=torch.uint8, pin_memory=dev.type == "cuda")
        self._event = None
        if dev.type == "cuda":
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                self._host.copy_(packed, non_blocking=True)
                packed.record_stream(side)
                self._event = torch.cuda.Event()
                self._event.record(side)
        else:
            self._host.copy_(packed)

    def wait(self) -> tuple[dict[str, torch.Tensor], list[int]]:
        if self._event is not None:
            self._event.synchronize()
        out = {}
        for name, dtype, numel, at in self._layout:
            size = torch.empty(0, dtype=dtype).element_size()
            out[name] = self._host[at : at + numel * size].view(dtype)
        counts = out.pop("counts").tolist()
        return trim(out, counts, self.plan), counts
