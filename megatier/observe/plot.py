"""Pictures of a run: one PNG per figure, drawn from its metrics across launches (:mod:`.run_history`).

    loss.png             loss and val_loss against step; each failure (the last step reached before it) and
                         each resumption (the step E recovery restored) marked
    step_time.png        step time (iter_time_s), and per step what it waited for: the checkpoint (ckpt_stall_ms),
                         data (data_wait_ms), data-parallel communication (dp_wait_ms), pipeline neighbours
                         (pp_bubble_ms)
    recovery_points.png  rpo_software / rpo_node / rpo_rack against the current step
    goodput.png          goodput per step and the final breakdown into goodput_<part>_s
    tier_bytes.png       bytes written per step (diff_bytes, base_bytes) and held (every other *_bytes key)
    moe_router.png       a mixture of experts' router: aux and z losses, tokens per expert (min, max), dropped
                         tokens

A figure whose metrics the run did not log (no checkpointing: no recovery points; a run without the goodput
ledger: no goodput) is skipped, with the reason. Figures are drawn on ``matplotlib.figure.Figure`` objects,
never through pyplot, so nothing needs a display and no figure outlives its function. Marks carry a gid
(``failure``, ``resumed``) so a test can find them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Optional

from matplotlib.figure import Figure

from megatier.observe.run_history import RunHistory, number

_MIB = 1 << 20
_RPO = ("rpo_software", "rpo_node", "rpo_rack")
_WRITTEN = ("diff_bytes", "base_bytes")  # bytes serialized this step; every other *_bytes key is held
GOODPUT = "goodput"  # the productive share of wall time; goodput_<part>_s are its parts in seconds
_GOODPUT_TOTALS = ("wall", "total")  # goodput_<total>_s is the sum of the parts, not a part
_STEP_WAITS = (("ckpt_stall_ms", "tab:purple"), ("data_wait_ms", "tab:green"), ("dp_wait_ms", "tab:orange"),
               ("pp_bubble_ms", "tab:brown"))  # what a step waited for, in ms


class NothingToPlot(Exception):
    """The run logged none of a figure's metrics; the message says which and why that happens."""


@dataclass
class PlotResult:
    """What :func:`write_plots` did: file -> what it shows, and figure file -> why it was skipped."""

    written: dict[str, str] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)


def _figure(rows: int = 1, *, sharex: bool = True) -> tuple[Figure, list]:
    fig = Figure(figsize=(10, 3.2 * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, 1, sharex=sharex, squeeze=False)[:, 0]
    return fig, list(axes)


def _lines(ax, history: RunHistory, key: str, label: str, scale: float = 1.0, **style) -> bool:
    """``key`` against step, one line per launch (one legend entry); whether there was anything to draw."""
    drawn = False
    for steps, values in history.series(key):
        (line,) = ax.plot(steps, [v * scale for v in values], label=None if drawn else label, **style)
        style.setdefault("color", line.get_color())  # every launch in the first launch's colour
        drawn = True
    return drawn


def _legend(ax, loc: str) -> None:
    """A legend at ``loc``; "outside" puts it right of the axes, where it never covers the data."""
    if ax.get_legend_handles_labels()[0]:
        if loc == "outside":
            ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, borderaxespad=0.0)
        else:
            ax.legend(loc=loc, fontsize=8)


def mark_recoveries(ax, history: RunHistory) -> int:
    """Mark each failure (red dashed line at the last step reached) and each resumption (green dotted line at E,
    the lost steps between them shaded); returns how many failures were marked."""
    for i, r in enumerate(history.recoveries):
        first = i == 0
        if r.failed_at is not None:
            ax.axvline(r.failed_at, color="tab:red", ls="--", lw=1.2, gid="failure",
                       label="failure (last step reached)" if first else None)
            if r.failed_at > r.resumed_at:
                ax.axvspan(r.resumed_at, r.failed_at, color="tab:red", alpha=0.12, lw=0,
                           label="steps trained again" if first else None)
            ax.annotate(f"{r.failure_class} failure", (r.failed_at, 1.0), xycoords=("data", "axes fraction"),
                        xytext=(3, -12), textcoords="offset points", color="tab:red", fontsize=8)
        ax.axvline(r.resumed_at, color="tab:green", ls=":", lw=1.5, gid="resumed",
                   label="resumed from step E" if first else None)
    return len(history.recoveries)


def loss_figure(history: RunHistory) -> Figure:
    """loss and val_loss against step, failures and resumptions marked."""
    fig, (ax,) = _figure()
    if not _lines(ax, history, "loss", "loss", color="tab:blue", lw=0.8, alpha=0.8):
        raise NothingToPlot("no loss in the step records")
    _lines(ax, history, "val_loss", "val_loss", color="tab:orange", marker="o", ms=3, lw=1.2)
    failures = mark_recoveries(ax, history)
    launches = len(history.trained_launches)
    ax.set(xlabel="step", ylabel="loss",
           title=f"loss ({failures} failure{'s' if failures != 1 else ''}, {launches} launch"
                 f"{'es' if launches != 1 else ''})")
    _legend(ax, "upper right")
    return fig


def step_time_figure(history: RunHistory) -> Figure:
    """Step time (iter_time_s), and what the step waited for (_STEP_WAITS: the checkpoint stall, data,
    data-parallel communication, pipeline neighbours), per step."""
    fig, (top, bottom) = _figure(2)
    if not _lines(top, history, "iter_time_s", "step time (iter_time_s, in ms)", scale=1000.0, color="tab:blue",
                  lw=0.8):
        raise NothingToPlot("no iter_time_s in the step records")
    top.set(ylabel="step time (ms)", title="step time, and the waits in it")
    if not [key for key, color in _STEP_WAITS if _lines(bottom, history, key, key, color=color, lw=0.8)]:
        bottom.text(0.5, 0.5, f"no {', '.join(key for key, _ in _STEP_WAITS)} in the step records",
                    transform=bottom.transAxes, ha="center")
    bottom.set(xlabel="step", ylabel="stall and wait (ms)")
    for ax in (top, bottom):
        mark_recoveries(ax, history)
        _legend(ax, "upper right")
    return fig


def recovery_points_figure(history: RunHistory) -> Figure:
    """The step each failure class would resume from, against the current step (the diagonal)."""
    fig, (ax,) = _figure()
    drawn = [key for key in _RPO if _lines(ax, history, key, key, drawstyle="steps-post", lw=1.2)]
    if not drawn:
        raise NothingToPlot(f"no {'/'.join(_RPO)} in the step records (checkpointing off, or the run ended before "
                            f"its first watermark sync)")
    steps = [r["step"] for r in history.steps]
    ax.plot([min(steps), max(steps)], [min(steps), max(steps)], color="0.6", lw=0.8, ls="--", label="current step")
    mark_recoveries(ax, history)
    ax.set(xlabel="step", ylabel="recovery point (step)",
           title="live recovery points (a failure now would resume from ...)")
    _legend(ax, "upper left")
    return fig


def goodput_parts(record: dict) -> dict[str, float]:
    """``goodput_<part>_s`` of ``record``, by part, in seconds (sums such as goodput_wall_s left out)."""
    parts = {}
    for key, value in record.items():
        if key.startswith(f"{GOODPUT}_") and key.endswith("_s") and (v := number(value)) is not None:
            part = key[len(GOODPUT) + 1:-2]
            if part not in _GOODPUT_TOTALS:
                parts[part] = v
    return parts


def goodput_figure(history: RunHistory) -> Figure:
    """Goodput per step (when logged) and the breakdown of wall time from the newest record that has one (the
    summary when it does)."""
    summary = history.summary or {}
    last = summary if goodput_parts(summary) else history.last_with(history.keys(prefix=f"{GOODPUT}_", suffix="_s"))
    has_share = bool(history.series(GOODPUT))
    if last is None and not has_share:
        raise NothingToPlot(f"no {GOODPUT} or {GOODPUT}_<part>_s keys in the records (a run from before the goodput "
                            f"ledger)")
    fig, (top, bottom) = _figure(2, sharex=False)
    if has_share:
        _lines(top, history, GOODPUT, GOODPUT, color="tab:green", lw=1.0)
        mark_recoveries(top, history)
        _legend(top, "lower right")
    else:
        top.text(0.5, 0.5, f"no per-step {GOODPUT} logged", transform=top.transAxes, ha="center")
    top.set(xlabel="step", ylabel="goodput (share of wall time)", ylim=(0, 1.02), title="goodput")
    _breakdown(bottom, goodput_parts(last) if last is not None else {}, last["step"] if last is not None else None)
    return fig


def _breakdown(ax, parts: dict[str, float], step: Optional[int]) -> None:
    """One horizontal bar of wall time stacked by part, each labelled with its seconds and share."""
    total = sum(parts.values())
    if total <= 0:
        ax.text(0.5, 0.5, f"no {GOODPUT}_<part>_s breakdown logged", transform=ax.transAxes, ha="center")
        return
    left = 0.0
    for part, seconds in parts.items():
        ax.barh([0], [seconds], left=left, gid=part, label=f"{part} {seconds:.1f} s ({100 * seconds / total:.1f}%)")
        left += seconds
    ax.set(yticks=[], xlabel="seconds", xlim=(0, total), title=f"where the wall time went (as of step {step})")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=3, fontsize=8)


def tier_bytes_figure(history: RunHistory) -> Figure:
    """Bytes serialized per step (diff_bytes; base_bytes at base steps) and bytes held (tier1_bytes and every
    other ``*_bytes`` key the run logged) over steps."""
    written = [k for k in _WRITTEN if history.series(k)]
    held = [k for k in history.keys(suffix="_bytes") if k not in _WRITTEN
            and any(v for _, values in history.series(k) for v in values)]  # all zero: nothing was held
    if not written and not held:
        raise NothingToPlot("no *_bytes keys in the step records (checkpointing off)")
    fig, (top, bottom) = _figure(2)
    if "diff_bytes" in written:
        _lines(top, history, "diff_bytes", "diff_bytes (a step's diff record)", scale=1 / _MIB, lw=0.8)
    if "base_bytes" in written:
        for i, (steps, values) in enumerate(history.series("base_bytes")):
            points = [(s, v / _MIB) for s, v in zip(steps, values) if v > 0]
            top.plot([s for s, _ in points], [v for _, v in points], "s", color="tab:red", ms=4,
                     label=None if i else "base_bytes (a base)")
    top.set(ylabel="MiB written", yscale="log", title="checkpoint bytes: written per step, held")
    for key in held:
        _lines(bottom, history, key, key, scale=1 / _MIB, lw=1.0, drawstyle="steps-post")
    if not held:
        bottom.text(0.5, 0.5, "no bytes-held metrics logged", transform=bottom.transAxes, ha="center")
    bottom.set(xlabel="step", ylabel="MiB held")
    for ax in (top, bottom):
        mark_recoveries(ax, history)
        _legend(ax, "outside")
    return fig


def moe_router_figure(history: RunHistory) -> Figure:
    """The router's health per step: its losses (moe_aux_loss, moe_z_loss), the load of the least and most
    used expert (moe_tokens_per_expert_min/max: a collapsing router drives them apart) and dropped tokens."""
    if not history.series("moe_aux_loss"):
        raise NothingToPlot("no moe_aux_loss in the step records (a model without model.moe)")
    fig, (losses, load) = _figure(2)
    _lines(losses, history, "moe_aux_loss", "moe_aux_loss", lw=0.8)
    _lines(losses, history, "moe_z_loss", "moe_z_loss", lw=0.8)
    losses.set(ylabel="router loss", title="mixture of experts: router losses and expert load")
    _lines(load, history, "moe_tokens_per_expert_min", "tokens per expert (min)", lw=0.8)
    _lines(load, history, "moe_tokens_per_expert_max", "tokens per expert (max)", lw=0.8)
    _lines(load, history, "moe_dropped_tokens", "dropped tokens", lw=0.8, color="tab:red")
    load.set(xlabel="step", ylabel="tokens")
    for ax in (losses, load):
        mark_recoveries(ax, history)
        _legend(ax, "outside")
    return fig


# File name -> (figure function, what it shows). A tuple: the set of figures is fixed.
FIGURES: tuple[tuple[str, Callable[[RunHistory], Figure], str], ...] = (
    ("loss.png", loss_figure, "loss and val_loss against step, failures and resumptions marked"),
    ("step_time.png", step_time_figure, "step time and checkpoint stall per step"),
    ("recovery_points.png", recovery_points_figure, "rpo_software/node/rack against the current step"),
    ("goodput.png", goodput_figure, "goodput per step and the wall-time breakdown"),
    ("tier_bytes.png", tier_bytes_figure, "checkpoint bytes written per step and held per tier"),
    ("moe_router.png", moe_router_figure, "router losses, tokens per expert (min, max) and dropped tokens"),
)


def write_plots(run_dir: str, out_dir: Optional[str] = None) -> PlotResult:
    """Draw every figure of ``run_dir``'s metrics into ``out_dir`` (default: ``run_dir``) as PNGs.

    Raises :class:`~megatier.observe.run_history.MetricsMissing` when ``run_dir`` has no step records.
    """
    history = RunHistory.read(run_dir)
    out_dir = out_dir or run_dir
    os.makedirs(out_dir, exist_ok=True)
    result = PlotResult()
    for name, draw, what in FIGURES:
        try:
            fig = draw(history)
        except NothingToPlot as why:
            result.skipped[name] = str(why)
            continue
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=110)
        result.written[path] = what
    return result
