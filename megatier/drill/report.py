"""The failure drill's verdict and report: what each failure class requires of a recovery, and the text."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from megatier.checkpoint.tiers.base import TIER1, TIER3
from megatier.drill.spec import DrillSpec
from megatier.observe.goodput import PARTS

if TYPE_CHECKING:
    from megatier.drill.job import Job


@dataclass
class Recovery:
    """One injected failure and what the relaunched job did about it."""

    at_step: int
    crash_status: int
    record: Optional[dict] = None
    timeline: Optional[dict] = None  # the recovery_* timing of the first step after it
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def max_steps_lost(fail: str, job: Job) -> Optional[int]:
    """What a failure class may lose: with step units, the step in flight (software) or the steps in flight to
    the ring peer too (node); without them, the open diff batch. A rack failure keeps the Tier-3 bound (None
    here: it depends on how far Tier-3 is behind)."""
    if fail == "rack":
        return None
    if not job.per_step:
        return job.batch
    return 1 if fail in ("software", "stage", "hang") else 2


def _check_stage(spec: DrillSpec, job: Job, rec: Recovery) -> None:
    """A stage failure: CheckFree rebuilt exactly that stage and says it is not exact; every other rank came
    from its own Tier-1 and nothing from Tier-3 (the rebuilt ranks read nothing)."""
    r, per_stage = rec.record, spec.nodes * spec.procs_per_node // job.pp
    lost = range(spec.stage * per_stage, (spec.stage + 1) * per_stage)
    cf = r.get("checkfree")
    if not cf or cf.get("stages") != [spec.stage]:
        rec.problems.append(f"stage {spec.stage} lost every copy but the recovery record shows no CheckFree rebuild "
                            f"of it (checkfree: {cf})")
    if r.get("exact") is not False:
        rec.problems.append("the recovery record does not say that a rebuilt stage is not exact")
    for q, tiers in enumerate(r.get("rank_tiers") or []):
        want = [] if q in lost else [TIER1]
        if tiers != want:
            rec.problems.append(f"rank {q} was served from {tiers or 'nothing'}, expected {want or 'nothing'}")
    if r["bytes_tier3"]:
        rec.problems.append(f"stage failure read {r['bytes_tier3']} bytes from Tier-3; the others' Tier-1 serves it")


def _check_in_place(spec: DrillSpec, rec: Recovery) -> None:
    """In-process recovery: the ranks the failure killed read their state; every survivor either kept its state
    in memory (at E: zero bytes read) or rolled back from its own Tier-1; the recovery was timed as in place."""
    r = rec.record
    if rec.timeline is not None and rec.timeline.get("recovery_mode") != "inprocess":
        rec.problems.append(f"the recovery was timed as {rec.timeline.get('recovery_mode')}, not inprocess")
    if r.get("resharded"):  # dp shrank: every rank read the old layout's units (checked as for a relaunch)
        return
    killed = set(spec.victim_ranks(spec.at_steps.index(rec.at_step)))
    in_place = set(r.get("ranks_in_place") or [])
    tiers = r.get("rank_tiers") or []
    if killed & in_place:
        rec.problems.append(f"ranks {sorted(killed & in_place)} were killed but kept their state in place")
    for q, t in enumerate(tiers):
        if q in in_place and t:
            rec.problems.append(f"rank {q} kept its state in place but read {t}")
        if q not in in_place and not t:
            rec.problems.append(f"rank {q} neither kept its state nor read one")
    if r["end"] == rec.at_step and not in_place:  # the survivors had finished step E and no more
        rec.problems.append("no survivor kept its state in place at E: the recovery was not in-process")


def unit_nodes(spec: DrillSpec, record: dict) -> list[str]:
    """The node each rank's units were written on, by the rank that wrote them: where it runs now, or after a
    resharded restore (``rank_tiers`` then counts the old layout's ranks) where it ran before (torchrun
    numbers ranks node by node)."""
    if record.get("resharded"):
        return [f"node{q // spec.procs_per_node}" for q in range(len(record.get("rank_tiers") or []))]
    return list(record.get("rank_nodes") or [])


def _gone(spec: DrillSpec) -> str:
    """What the restore sees as lost: a shrink leaves the dropped replicas' nodes, whose newest steps then come
    from their ring replicas, as a lost node's."""
    return "node" if spec.no_spare else spec.fail


def _lost_bound(spec: DrillSpec, job: Job) -> Optional[int]:
    return max_steps_lost(_gone(spec), job)


def check_recovery(spec: DrillSpec, job: Job, rec: Recovery) -> None:
    """Compare one recovery record with what its failure class requires; problems make the drill fail."""
    r = rec.record
    if r is None:
        rec.problems.append("the relaunched job logged no recovery record: it did not recover")
        return
    lost = rec.at_step - r["end"]
    r["steps_lost_drill"] = lost  # from the step the drill killed at (Tier-1 progress may be wiped)
    tiers, nodes = r.get("rank_tiers") or [], unit_nodes(spec, r)
    lost_nodes = {f"node{i}" for i in spec.victims()}
    inplace = spec.inprocess and (rec.timeline or {}).get("recovery_mode") != "relaunch"
    if spec.inprocess:  # a spare node's ranks replaced the lost node's
        lost_nodes |= {f"node{spec.nodes + i}" for i in range(spec.launch.spare_nodes)}
    if inplace:
        _check_in_place(spec, rec)
    if spec.no_spare and rec.at_step == spec.at_steps[0] and not r.get("resharded"):  # later: dp stays
        rec.problems.append("the job carried on without a spare node but its restore did not reshard")
    gone = _gone(spec)
    bound = _lost_bound(spec, job)
    if bound is not None and lost > bound:
        what = f"{spec.fail} failure" + (" without a spare" if spec.no_spare else "")
        rec.problems.append(f"{lost} steps lost (killed at {rec.at_step}, resumed after {r['end']}); a {what} may "
                            f"lose at most {bound}")
    if spec.fail == "stage":
        _check_stage(spec, job, rec)
        return
    if spec.fail == "rack":
        wrong = [q for q, t in enumerate(tiers) if t != [TIER3]]
        if wrong or r["failure_class"] != "rack":
            rec.problems.append(f"rack failure: ranks {wrong} were not served from Tier-3 only "
                                f"(class {r['failure_class']})")
        return
    if spec.corrupt and not any("base" in f and "xxh64" in f for f in r.get("fallbacks", [])):
        rec.problems.append("the corrupted Tier-1 base was not reported as a failed checksum in the fallbacks")
    if spec.corrupt:
        return  # the corrupted rank rightly reads its base from another tier
    for q, (t, node) in enumerate(zip(tiers, nodes)):
        if inplace and not t:
            continue  # kept in place (checked above)
        if node not in lost_nodes or gone in ("software", "hang"):
            if t != [TIER1]:
                rec.problems.append(f"rank {q} on surviving {node} was served from {t}, not its own Tier-1")
        elif TIER1 in t and not spec.no_spare:
            # (Without a spare, its replica on a survivor is read by a rank there: that node's own memory.)
            rec.problems.append(f"rank {q} on the replaced {node} was served from Tier-1, which was wiped")
        elif TIER3 in t:
            rec.notes.append(f"rank {q} read from {t}: the newest base's Tier-2 replica was still in transfer "
                             f"(pick --at-step later in a base interval to exercise Tier-2)")
    if gone in ("software", "hang") and r["bytes_tier3"]:
        rec.problems.append(f"software failure read {r['bytes_tier3']} bytes from Tier-3; Tier-1 should serve it")
    if gone == "node" and r["bytes_tier3"] and not rec.notes:
        rec.problems.append(f"node failure read {r['bytes_tier3']} bytes from Tier-3")


def _mib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / (1 << 20):.2f} MiB"


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.6f}"


def _val_delta(final: dict, reference: dict) -> str:
    # Validation loss averages over fixed held-out batches, so it is the steadier measure of "ended in the same
    # place" than one training batch's loss when lossy diffs let the two runs drift apart.
    if final.get("val_loss") is None or reference.get("val_loss") is None:
        return ""
    rel = abs(final["val_loss"] - reference["val_loss"]) / abs(reference["val_loss"])
    return f", val_loss by {100 * rel:.4f}%"


def stall_summary(records: list[dict]) -> Optional[dict]:
    """How long the loop waited on checkpointing per step (``ckpt_stall_ms``, as the metrics log it: rank 0,
    every launch) against the step itself (``iter_time_s``): median, p99 and max."""
    stalls = sorted(r["ckpt_stall_ms"] for r in records if r.get("ckpt_stall_ms") is not None)
    steps = [1000.0 * r["iter_time_s"] for r in records if r.get("iter_time_s") is not None]
    if len(stalls) < 2 or not steps:
        return None
    return {"steps": len(stalls), "median_ms": statistics.median(stalls),
            "p99_ms": statistics.quantiles(stalls, n=100, method="inclusive")[98], "max_ms": stalls[-1],
            "step_median_ms": statistics.median(steps)}


def _stall_line(stall: Optional[dict]) -> list[str]:
    if stall is None:
        return []
    return [f"  stall: ckpt_stall_ms median {stall['median_ms']:.1f}, p99 {stall['p99_ms']:.1f}, max "
            f"{stall['max_ms']:.1f} over {stall['steps']} steps (rank 0, every launch); step median "
            f"{stall['step_median_ms']:.0f} ms, so the max is {100 * stall['max_ms'] / stall['step_median_ms']:.1f}%"
            f" of a step"]


def goodput_fields(summary: dict) -> Optional[dict]:
    """``goodput`` and its ``goodput_*`` parts from the job's summary record (the ledger's totals over every
    launch, :mod:`megatier.observe.goodput`), or None when the run logged none."""
    fields = {k: v for k, v in summary.items() if k == "goodput" or k.startswith("goodput_")}
    return fields if "goodput_wall_s" in fields else None


def _seconds(x: float) -> str:
    return f"{x:.2f} s" if x >= 1 else f"{x:.3f} s"


def _goodput_line(summary: dict) -> list[str]:
    g = goodput_fields(summary)
    if g is None:
        return []
    n = g.get("goodput_steps_lost", 0)
    lost = f" ({n} step{'' if n == 1 else 's'})"
    parts = ", ".join(f"{p} {_seconds(g[f'goodput_{p}_s'])}" + (lost if p == "lost" else "") for p in PARTS)
    return [f"  goodput: {100 * g['goodput']:.1f}% of {_seconds(g['goodput_wall_s'])} held over every launch: {parts}"]


def _checkfree_lines(r: dict) -> list[str]:
    cf = r.get("checkfree")
    if not cf:
        return []
    how = "; ".join(f"stage {b['stage']} from stages {b['neighbours']} weighted {b['weights']}" for b in cf["rebuilds"])
    return [f"    CheckFree ({cf['init']}): {how or 'a fresh initialisation'}; lr x {cf['lr_scale']}. NOT exact: "
            f"the run differs from the one that failed from step {cf['at_step']} on (inexact_since in its metrics)"]


def _timeline_lines(t: Optional[dict]) -> list[str]:
    if not t:
        return []
    n = t["recovery_steps_rerun"]
    if t["recovery_mode"] == "inprocess":
        detection, reform = "a survivor's collective failed", "checkpoint threads stopped, round, process groups, tiers"
    else:
        detection = "the launcher saw it, stopped the rest, started anew"
        reform = "imports, process groups, model, tiers"
    return [f"    failure to the first step after it {_seconds(t['recovery_total_s'])} ({t['recovery_mode']}): "
            f"detection {_seconds(t['recovery_detection_s'])} ({detection}), "
            f"re-form {_seconds(t['recovery_reform_s'])} ({reform}), restore "
            f"{_seconds(t['recovery_restore_s'])}, rerun {_seconds(t['recovery_rerun_s'])} (step E+1; {n} step"
            f"{'' if n == 1 else 's'} lay between E and the failure)"]


def format_report(spec: DrillSpec, job: Job, recoveries: list[Recovery], final: dict, status: int,
                  reference: Optional[dict], problems: list[str], stall: Optional[dict] = None) -> str:
    """The human-readable drill report."""
    who = ("every node" if spec.fail == "rack" else f"pipeline stage {spec.stage}" if spec.fail == "stage"
           else f"node{spec.victim_node}")
    lines = [f"failure drill: {spec.fail} failure ({who}) at step(s) {', '.join(map(str, spec.at_steps))} on "
             f"{spec.nodes} nodes x {spec.procs_per_node} processes; job {job.job_id!r}, diff "
             f"{job.compression} batch {job.batch}, {job.iters} steps; logs and tiers in {job.work}"
             + ("" if job.local_root.startswith(job.work) else f" (node memory in {job.local_root}, freed at exit)")]
    for i, rec in enumerate(recoveries, 1):
        r = rec.record
        how = "recovered in the same launch, which exited" if spec.inprocess else "launch exit"
        lines.append(f"  failure {i}: killed at step {rec.at_step} ({how} {rec.crash_status})")
        if r is None:
            continue
        old = "old " if r.get("resharded") else ""
        kept = set(r.get("ranks_in_place") or [])
        sources = ", ".join(f"{old}rank {q}@{node}: {'+'.join(t) or ('in place' if q in kept else '-')}"
                            for q, (t, node) in enumerate(zip(r.get("rank_tiers") or [], unit_nodes(spec, r))))
        lines += [
            f"    class {r['failure_class']} (injected {spec.fail}); base V={r['version']}, replayed to E={r['end']}, "
            f"steps lost {r.get('steps_lost_drill')}" + (f" (at most {bound})" if (bound := _lost_bound(
                spec, job)) is not None else ""),
            f"    source tier per rank: {sources}",
            *([f"    resharded (tp,pp,dp) {r['resharded']}: carried on without a spare node (the lost node's ranks "
               f"read from their replicas by ranks on the survivors: their own node's memory, so counted as tier1 "
               f"and the class as seen by the readers); canonical digest at E {r.get('canonical_digest')}"]
              if r.get("resharded") else []),
            f"    bases by tier: {r['source_tiers']}; bytes read tier1 {_mib(r['bytes_tier1'])}, tier2 "
            f"{_mib(r['bytes_tier2'])}, tier3 {_mib(r['bytes_tier3'])}",
            f"    t_consensus {r['t_consensus_s']:.3f} s, t_rollback {r['t_rollback_s']:.3f} s, t_replay "
            f"{r['t_replay_s']:.3f} s" + (f"; fallbacks: {'; '.join(r['fallbacks'])}" if r.get("fallbacks") else ""),
            *_checkfree_lines(r), *_timeline_lines(rec.timeline)]
        lines += [f"    note: {n}" for n in rec.notes]
    if final:
        lines.append(f"  final: step {final.get('step')} loss {final.get('loss', float('nan')):.6f} val_loss "
                     f"{_fmt(final.get('val_loss'))} state_digest {final.get('state_digest')} (exit {status})")
        lines.append(f"  metrics: {job.run_dir}/metrics.jsonl (the launch before each failure: metrics.<n>.jsonl)")
    lines += _stall_line(stall)
    lines += _goodput_line(final)
    if reference is not None and spec.no_spare:
        got = recoveries[0].record.get("canonical_digest") if recoveries[0].record else None
        same = got == reference.get("canonical_digest")
        lines.append(f"  compare: fault-free run to E={reference.get('step')}: canonical digest "
                     f"{reference.get('canonical_digest')} -> {'bit-identical' if same else 'different'} to the "
                     f"resharded restore's")
    elif reference is not None:
        same = reference.get("state_digest") == final.get("state_digest")
        ref_loss = reference.get("loss", float("nan"))  # a reference that trained no step has none
        rel = abs(final.get("loss", 0.0) - ref_loss) / abs(ref_loss) if ref_loss else float("nan")
        lines.append(f"  compare: fault-free loss {ref_loss:.6f} val_loss {_fmt(reference.get('val_loss'))} "
                     f"state_digest {reference['state_digest']} -> {'bit-identical' if same else 'different'}; "
                     f"final loss differs by {100 * rel:.4f}%" + _val_delta(final, reference))
    lines += [f"  FAILED CHECK: {p}" for p in problems]
    lines.append("RESULT: " + ("recovery as the class requires" if not problems else "recovery did NOT happen as "
                                                                                     "the class requires"))
    return "\n".join(lines)


def final_problems(spec: DrillSpec, job: Job, recoveries: list[Recovery], final: dict, status: int,
                   reference: Optional[dict]) -> list[str]:
    problems = [p for rec in recoveries for p in rec.problems]
    if status != 0 or final.get("step") != job.iters:
        problems.append(f"the recovered job did not finish: exit {status}, last summary step {final.get('step')} "
                        f"of {job.iters}; see the last launch log in {job.work}")
    if reference is not None and spec.no_spare:
        got = recoveries[0].record.get("canonical_digest") if recoveries[0].record else None
        if job.compression == "fp32" and got != reference.get("canonical_digest"):
            problems.append(f"with lossless diffs the resharded state at E must equal the fault-free run's there; "
                            f"canonical digests {got} vs {reference.get('canonical_digest')}")
    elif reference is not None and final and job.compression == "fp32" and spec.fail != "stage" and \
            reference.get("state_digest") != final.get("state_digest"):
        problems.append("with lossless diffs (fp32) the recovered run must end bit-identical to the fault-free run; "
                        f"digests {final.get('state_digest')} vs {reference.get('state_digest')}")
    return problems


