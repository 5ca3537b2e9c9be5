"""megatier-plot: figures from a real short run and from a failure drill's metrics; a clear error without metrics."""
from __future__ import annotations

import json
import os

import pytest

from megatier.cli.plot import main as plot_main
from megatier.observe.plot import goodput_figure, loss_figure, step_time_figure, tier_bytes_figure, write_plots
from megatier.observe.run_history import MetricsMissing, RunHistory, metrics_files
from megatier.training.trainer import Trainer

pytestmark = pytest.mark.timeout(120)

ALWAYS = {"loss.png", "step_time.png", "recovery_points.png", "tier_bytes.png"}
PARTS = {"productive": 80.0, "ckpt_stall": 2.0, "restore": 1.5, "lost": 3.0, "restart": 12.0, "eval": 1.5}


def _write(path, records) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def _step(step: int, **extra) -> dict:
    return {"step": step, "loss": 5.0 - 0.1 * step, "iter_time_s": 0.05, "ckpt_stall_ms": 1.5, "diff_bytes": 4000,
            "dp_wait_ms": 3.0, "pp_bubble_ms": 4.0,
            "base_bytes": 600_000 if step % 10 == 0 else 0, "tier1_bytes": 1_000_000 + 5000 * step,
            "rpo_software": step - 1, "rpo_node": step - 2, "rpo_rack": step - 5,
            "goodput": 0.8, **{f"goodput_{p}_s": s * step / 20 for p, s in PARTS.items()}, **extra}


@pytest.fixture
def drill_dir(tmp_path):
    """A node drill's run directory: launch 1 dies after step 12, launch 2 recovers to E=10 and finishes at 20."""
    run = tmp_path / "run"
    run.mkdir()
    _write(run / "metrics.1.jsonl", [_step(s) for s in range(1, 13)])
    recovery = {"step": 10, "event": "recovery", "failure_class": "node", "last_step": 12, "steps_lost": 2,
                "t_consensus_s": 0.01, "t_rollback_s": 0.1, "t_replay_s": 0.2}
    summary = {"step": 20, "event": "summary", "loss": 3.0, **{f"goodput_{p}_s": s for p, s in PARTS.items()},
               "goodput_wall_s": sum(PARTS.values())}
    _write(run / "metrics.jsonl", [recovery] + [_step(s) for s in range(11, 21)] + [summary])
    with open(run / "metrics.1.jsonl", "a") as f:  # the killed launch's last line is cut short
        f.write('{"step": 13, "lo')
    return run


def _marks(fig, gid: str) -> list[float]:
    return [line.get_xdata()[0] for ax in fig.axes for line in ax.lines if line.get_gid() == gid]


def test_a_drills_launches_are_read_in_order_with_the_failure_and_the_resumption(drill_dir):
    history = RunHistory.read(str(drill_dir))
    assert [os.path.basename(launch.path) for launch in history.launches] == ["metrics.1.jsonl", "metrics.jsonl"]
    assert history.unparsed == 1  # the partial line
    (rec,) = history.recoveries
    assert (rec.launch, rec.failed_at, rec.resumed_at, rec.failure_class) == (1, 12, 10, "node")
    assert rec.restore_s == pytest.approx(0.31)
    assert [s for s, _ in history.series("loss")] == [list(range(1, 13)), list(range(11, 21))]


def test_a_drills_figures_mark_each_failure_and_resumption(drill_dir, tmp_path):
    history = RunHistory.read(str(drill_dir))
    loss = loss_figure(history)
    assert _marks(loss, "failure") == [12] and _marks(loss, "resumed") == [10]
    assert _marks(tier_bytes_figure(history), "failure") == [12, 12]  # both panels
    bars = {p.get_gid(): p.get_width() for ax in goodput_figure(history).axes for p in ax.patches if p.get_gid()}
    assert bars == PARTS  # from the summary; goodput_wall_s is their sum, not a part
    result = write_plots(str(drill_dir), str(tmp_path / "out"))
    assert {os.path.basename(p) for p in result.written} == ALWAYS | {"goodput.png"}
    assert set(result.skipped) == {"moe_router.png"}  # a dense run
    for path in result.written:
        assert os.path.dirname(path) == str(tmp_path / "out") and os.path.getsize(path) > 10_000


def test_rotated_files_sort_by_launch_number(tmp_path):
    for name in ("metrics.jsonl", "metrics.10.jsonl", "metrics.2.jsonl", "metrics.1.jsonl", "other.jsonl"):
        (tmp_path / name).write_text("")
    names = [os.path.basename(p) for p in metrics_files(str(tmp_path))]
    assert names == ["metrics.1.jsonl", "metrics.2.jsonl", "metrics.10.jsonl", "metrics.jsonl"]


def test_a_rack_failure_without_last_step_is_marked_at_the_failed_launchs_last_step(tmp_path):
    _write(tmp_path / "metrics.1.jsonl", [{"step": s, "loss": 1.0} for s in range(1, 8)])
    _write(tmp_path / "metrics.jsonl", [{"step": 5, "event": "recovery", "failure_class": "rack", "last_step": None},
                                        {"step": 6, "loss": 1.0}])
    (rec,) = RunHistory.read(str(tmp_path)).recoveries
    assert (rec.failed_at, rec.resumed_at) == (7, 5)


def test_a_directory_without_metrics_is_one_clear_error(tmp_path, capsys):
    with pytest.raises(MetricsMissing, match="has no metrics.jsonl"):
        write_plots(str(tmp_path))
    assert plot_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has no metrics.jsonl" in err and "logging.run_dir" in err
    assert plot_main([str(tmp_path / "absent")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    _write(tmp_path / "metrics.jsonl", [{"step": 0, "event": "recovery"}])
    assert plot_main([str(tmp_path)]) == 2
    assert "hold no step records" in capsys.readouterr().err
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".png")]


def test_figures_from_a_real_short_run(tiny_config, tmp_path, capsys):
    """A tiny model, tiered checkpointing on one process (Tier-1 + Tier-3), 10 steps: every figure whose metrics
    such a run logs is written; goodput is written or skipped with its reason."""
    cfg = tiny_config("checkpoint=tiered", "checkpoint.tiers=[local,remote]", f"checkpoint.local.root={tmp_path}/shm",
                      f"checkpoint.remote.url={tmp_path}/t3", "checkpoint.base_interval=5", "train.iters=10")
    trainer = Trainer(cfg)
    trainer.train()
    trainer.close()
    assert plot_main([cfg.logging.run_dir]) == 0
    out = capsys.readouterr().out
    written = {n for n in os.listdir(cfg.logging.run_dir) if n.endswith(".png")}
    assert ALWAYS <= written, out
    assert "goodput.png" in written or "skipped goodput.png: no goodput" in out
    for name in written:
        assert os.path.getsize(os.path.join(cfg.logging.run_dir, name)) > 10_000
    history = RunHistory.read(cfg.logging.run_dir)
    assert not history.recoveries and not _marks(loss_figure(history), "failure")


def test_a_continuation_and_a_refused_launch_are_no_failures(tmp_path):
    """A launch refused before its restore (an empty metrics file) and a relaunch after a clean exit (recovery
    record with failure_class none) add no failure and no launch to the loss plot's title."""
    run = tmp_path / "run"
    run.mkdir()
    _write(run / "metrics.1.jsonl", [_step(s) for s in range(1, 11)] + [{"step": 10, "event": "summary"}])
    _write(run / "metrics.2.jsonl", [])
    _write(run / "metrics.jsonl", [{"step": 10, "event": "recovery", "failure_class": "none", "last_step": 10,
                                    "steps_lost": 0}] + [_step(s) for s in range(11, 16)])
    history = RunHistory.read(str(run))
    assert history.recoveries == [] and len(history.trained_launches) == 2
    assert loss_figure(history).axes[0].get_title() == "loss (0 failures, 2 launches)"


def test_legends_say_what_is_drawn_and_stay_off_the_data(drill_dir):
    history = RunHistory.read(str(drill_dir))
    labels = [t.get_text() for t in step_time_figure(history).axes[0].get_legend().get_texts()]
    assert labels[0] == "step time (iter_time_s, in ms)"
    waits = [t.get_text() for t in step_time_figure(history).axes[1].get_legend().get_texts()]
    assert waits[:3] == ["ckpt_stall_ms", "dp_wait_ms", "pp_bubble_ms"]  # the drill's steps carry no data_wait_ms
    for ax in tier_bytes_figure(history).axes:
        box = ax.get_legend().get_bbox_to_anchor().transformed(ax.transAxes.inverted())
        assert box.x0 >= 1.0  # right of the axes
