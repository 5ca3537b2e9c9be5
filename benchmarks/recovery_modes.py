"""bench_recovery's ``modes`` part: the same failures recovered by relaunch and in process, side by side.

For each class (software: one process killed; node: a node's processes killed and its memory wiped; shrink,
asked for by name: a node failure with no spare, ``--no-spare``, so dp shrinks) and each failure point of the
classes part (``--points`` offsets into the second base interval), two ``megatier-drill`` runs of the same
job: ``--recovery relaunch`` (torchrun agents; the job is started again, on the survivors for shrink) and
``--recovery inprocess`` (megatier-agent; survivors re-form the job with a hot spare on the node, or a node
of spares, or on their own with a smaller dp). Each drill's goodput ledger times its recovery from the failure (the last
completed step's ledger update) to the end of the first step after it, in four parts that add up
(``recovery_*_s`` of that step's record):

  detection   the failure -> acted on (relaunch: the new process started, after the launcher stopped the
              survivors, the drill's 5 s grace included; in place: a survivor's collective failed)
  re-form     -> the restore began (relaunch: interpreter, imports, rendezvous, process groups, data, model,
              tiers; in place: checkpoint threads stopped, membership round, process groups, tiers)
  restore     the recovery record's consensus + rollback + replay
  rerun       -> the end of the first step after the restore

Reported per class and mode: the mean of each part and of the total over the points, the speedup of in
process over relaunch (relaunch total / in-process total), the issue's targets (in process: software
<= 1.5 s and node <= 2.5 s, and at least 5x faster than relaunch), and the baseline's end to end at the same
points: a full ``torch.save`` every ``--baseline-k`` steps, reloaded by a relaunch (the relaunch's
detection + re-form, measured here), then recomputing the steps since it.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Optional

MODES = ("relaunch", "inprocess")
MODE_CLASSES = ("software", "node", "shrink")
TARGET_S = {"software": 1.5, "node": 2.5}  # kill to the first new step, in process (the issue; none for shrink)
TARGET_SPEEDUP = 5.0
SPLIT = ("detection", "reform", "restore", "rerun")


def modes_command(drill_command: list[str], mode: str, failure: str = "") -> list[str]:
    """A drill's command line with ``--recovery mode`` (before the job's overrides), and ``--no-spare`` for
    the shrink class."""
    split = drill_command.index("--")
    shrink = ["--no-spare"] if failure == "shrink" else []
    return [*drill_command[:split], "--recovery", mode, *shrink, *drill_command[split:]]


def drilled_failure(failure: str) -> str:
    """The drill's ``--fail`` of a modes class (shrink drills a node failure)."""
    return "node" if failure == "shrink" else failure


def mode_point(failure: str, mode: str, offset: int, fraction: float, report: dict, step_s: float, load_s: float,
               k: int, baseline_lost: float) -> dict:
    """One drill's recovery timing, and the baseline's end to end at the same point."""
    t = report["recovery_timelines"][0] or {}
    rec = report["recoveries"][0]
    row = {"class": failure, "mode": mode, "offset": offset, "fraction": fraction, "at_step": report["at_steps"][0],
           "end": rec["end"], "ranks_in_place": rec.get("ranks_in_place") or [],
           "rank_tiers": rec.get("rank_tiers"), "measured_mode": t.get("recovery_mode"),
           **{f"{p}_s": t.get(f"recovery_{p}_s") for p in SPLIT}, "total_s": t.get("recovery_total_s")}
    if mode == "relaunch" and row["total_s"] is not None:
        # A baseline relaunch pays the same detection and re-form, then reloads and recomputes since its save.
        row["baseline_e2e_s"] = row["detection_s"] + row["reform_s"] + load_s + (baseline_lost + 1) * step_s
    return row


def mode_summary(failure: str, rows: list[dict]) -> dict:
    """Means over the points of each mode, the speedup and the targets."""
    out: dict = {"class": failure, "points": len(rows) // len(MODES)}
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode and r["total_s"] is not None]
        out[mode] = {f"{p}_s": statistics.fmean(r[f"{p}_s"] for r in mine) if mine else None
                     for p in (*SPLIT, "total")}
        if mine:
            totals = [r["total_s"] for r in mine]
            out[mode].update(min_s=min(totals), max_s=max(totals))
    base = [r["baseline_e2e_s"] for r in rows if r.get("baseline_e2e_s") is not None]
    out["baseline_e2e_s"] = statistics.fmean(base) if base else None
    relaunch, inprocess = out["relaunch"]["total_s"], out["inprocess"]["total_s"]
    out["speedup"] = relaunch / inprocess if relaunch and inprocess else None
    out["target_s"] = TARGET_S.get(failure)
    out["met"] = None if out["target_s"] is None else bool(
        inprocess is not None and inprocess <= out["target_s"] and out["speedup"] is not None
        and out["speedup"] >= TARGET_SPEEDUP)
    return out


def _s(value: Optional[float]) -> str:
    return f"{value:8.2f}" if value is not None else f"{'-':>8}"


def format_modes_report(out: dict) -> str:
    lines = [f"modes: kill to the end of the first new step, mean over {out['points']} points per class "
             f"(seconds; offsets {out['offsets']} into base interval {out['base_interval']})",
             f"{'class':<9} {'mode':<10} {'detect':>8} {'re-form':>8} {'restore':>8} {'rerun':>8} {'total':>8} "
             f"{'min':>8} {'max':>8}"]
    for s in out["classes"]:
        for mode in MODES:
            m = s[mode]
            lines.append(f"{s['class']:<9} {mode:<10} " + " ".join(_s(m.get(f"{p}_s")) for p in (*SPLIT, "total"))
                         + f" {_s(m.get('min_s'))} {_s(m.get('max_s'))}")
        speed = f"{s['speedup']:.1f}x" if s["speedup"] is not None else "-"
        total = _s(s["inprocess"]["total_s"]).strip()
        verdict = (f"{speed} faster than relaunch, {total} s (no target)" if s["met"] is None else
                   f"{speed} faster than relaunch (target >= {TARGET_SPEEDUP:g}x), {total} s (target <= "
                   f"{s['target_s']:g} s): {'met' if s['met'] else 'MISSED'}")
        lines.append(f"{'':<9} in process {verdict}; baseline (full save every {out['baseline_k']} steps, "
                     f"relaunched) end to end {_s(s['baseline_e2e_s']).strip()} s")
    return "\n".join(lines)


def run_modes(args: argparse.Namespace, work: str, br) -> dict:
    """Every point of every class in both modes (``br``: the bench_recovery module, for its drill plumbing)."""
    classes = [c for c in args.classes if c in MODE_CLASSES]
    offsets = br.point_offsets(args.points, args.base_interval)
    fractions = br.point_fractions(args.points)
    reports = []
    for failure in classes:
        for offset, fraction in zip(offsets, fractions):
            for mode in MODES:
                at_step = br.failure_step(offset, args.base_interval)
                name = f"modes-{failure}-{mode}-o{offset}"
                drill_work, json_path, log_path = (os.path.join(work, name + ext) for ext in ("", ".json", ".log"))
                print(f"modes: {failure} failure after step {at_step} (o={offset}), {mode} ...", flush=True)
                t = time.perf_counter()
                cmd = br.drill_command(args, drilled_failure(failure), at_step, drill_work, json_path)
                cmd = modes_command(cmd, mode, failure)
                report = br.run_drill(cmd, json_path, log_path, args.drill_timeout_s)
                print(f"  drill done in {time.perf_counter() - t:.0f} s", flush=True)
                reports.append((failure, mode, offset, fraction, report))
    load = br.measure_full_load(args, work)
    step_s = br.mean_step_time([r[4].get("run_dir") for r in reports]) or load["step_s_world1"]
    rows = [mode_point(*r, step_s, load["load_s"], args.baseline_k, br.baseline_rerun_steps(r[3], args.baseline_k))
            for r in reports]
    out = {"base_interval": args.base_interval, "offsets": offsets, "baseline_k": args.baseline_k,
           "baseline_load_s": load["load_s"], "step_s": step_s, "points": args.points, "rows": rows,
           "classes": [mode_summary(c, [r for r in rows if r["class"] == c]) for c in classes]}
    print(format_modes_report(out), flush=True)
    return out


if __name__ == "__main__":
    sys.exit("run benchmarks/bench_recovery.py --part modes")
