"""Metrics sinks: a JSONL file always, Weights & Biases and TensorBoard when enabled, a progress bar.

Only the writer rank (global rank 0) constructs a ``MetricsLogger``; other
ranks use ``NullLogger``. wandb defaults to offline mode, so nothing needs an
account or a network; ``wandb sync <dir>`` uploads an offline run later.

``train.log_interval`` (Megatron's --log-interval) thins what people watch: W&B, TensorBoard and the progress
bar get a step's record at multiples of it, at the last step, and whenever it carries val_loss or a stop;
records of events (recovery, rerun, summary) always. metrics.jsonl keeps every step: the goodput ledger's
fields, megatier-plot, megatier-inspect and the tests read it step by step.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Optional

from omegaconf import OmegaConf

from megatier.config import LoggingConfig
from megatier.observe.tensorboard import TensorBoardSink


def _rotate(path: str) -> None:
    """Keep an earlier run's metrics as metrics.<k>.jsonl instead of overwriting them."""
    if not os.path.exists(path):
        return
    stem, ext = os.path.splitext(path)
    k = 1
    while os.path.exists(f"{stem}.{k}{ext}"):
        k += 1
    os.replace(path, f"{stem}.{k}{ext}")


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no inf/nan; keep the record parseable
    return value


class MetricsLogger:
    """Writes one JSON object per line to ``<run_dir>/metrics.jsonl`` and mirrors it to wandb.

    Nothing is written until the first record: a launch refused while it builds (a changed config, a foreign
    checkpoint) leaves the run directory as it was, with no config.yaml of the refused config, no rotated or
    empty metrics file, no wandb run and no progress bar before its one line. The first record then writes
    ``run_config`` to config.yaml, rotates the earlier launch's metrics and opens the sinks."""

    def __init__(self, cfg: LoggingConfig, run_dir: str, run_config: dict, *, total_steps: int, resume: bool = False):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._cfg, self._run_config, self._total_steps, self._resume = cfg, run_config, total_steps, resume
        self._interval = int((run_config.get("train") or {}).get("log_interval") or 1)
        self._file = self._wandb = self._bar = self._tensorboard = None

    def _open(self) -> None:
        if self._file is not None:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, "config.yaml"), "w") as f:
            f.write(OmegaConf.to_yaml(self._run_config))
        if not self._resume:
            _rotate(self.path)
        self._file = open(self.path, "a", buffering=1)
        self._wandb = self._init_wandb(self._cfg, self.run_dir, self._run_config)
        self._tensorboard = TensorBoardSink(self._cfg.tensorboard_dir) if self._cfg.tensorboard else None
        self._bar = self._init_progress(self._cfg.progress, self._total_steps)

    @staticmethod
    def _init_wandb(cfg: LoggingConfig, run_dir: str, run_config: dict):
        if cfg.wandb.mode == "disabled":
            return None
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        return wandb.init(mode=cfg.wandb.mode, project=cfg.wandb.project, name=cfg.wandb.name or cfg.name,
                          tags=list(cfg.wandb.tags), dir=run_dir, config=run_config, reinit="finish_previous")

    @staticmethod
    def _init_progress(enabled: bool, total: int):
        if not enabled:
            return None
        from tqdm import tqdm

        return tqdm(total=total, unit="step", dynamic_ncols=True, mininterval=1.0)

    @property
    def wandb_dir(self) -> Optional[str]:
        return self._wandb.dir if self._wandb is not None else None

    @property
    def tensorboard_dir(self) -> Optional[str]:
        return self._tensorboard.log_dir if self._tensorboard is not None else None

    def _due(self, record: dict) -> bool:
        """Whether the watched sinks get ``record`` (train.log_interval; module docstring)."""
        step = record.get("step")
        if step is None or "event" in record or "val_loss" in record or "stop_requested" in record:
            return True
        return step % self._interval == 0 or step == self._total_steps

    def log(self, record: dict) -> None:
        self._open()
        record = {k: _jsonable(v) for k, v in record.items()}
        self._file.write(json.dumps(record) + "\n")
        if not self._due(record):
            return
        numeric = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        if self._wandb is not None:
            self._wandb.log(numeric, step=record.get("step"))
        # The summary repeats the last step's fields at its step: W&B keeps it as the run's summary, TensorBoard
        # would plot a second point there.
        if self._tensorboard is not None and record.get("step") is not None and record.get("event") != "summary":
            self._tensorboard.log(numeric, record["step"])

    def progress(self, step: int, loss: float, tokens_per_s: float) -> None:
        self._open()
        if self._bar is not None and (step % self._interval == 0 or step == self._total_steps):
            self._bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
            self._bar.update(step - self._bar.n)  # redraws at most once per mininterval

    def summary(self, record: dict) -> None:
        """The run's last record (carries state_digest); also stored as the wandb run summary."""
        self.log(record)
        if self._wandb is not None:
            for k, v in record.items():
                self._wandb.summary[k] = v

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._file is not None:
            self._file.close()


class NullLogger:
    """What non-writer ranks hold: every call is a no-op."""

    run_dir = None
    path = None
    wandb_dir = None
    tensorboard_dir = None

    def log(self, record: dict) -> None:
        pass

    def progress(self, step: int, loss: float, tokens_per_s: float) -> None:
        pass

    def summary(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass
