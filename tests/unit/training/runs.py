"""Running a whole single-process training job in a test and reading back its metrics records."""
from __future__ import annotations

import json
import os

from megatier.training.trainer import Trainer


def train_records(cfg) -> list[dict]:
    """Train ``cfg`` to the end, close it, and return every record its metrics.jsonl holds."""
    trainer = Trainer(cfg)
    trainer.train()
    trainer.close()
    with open(os.path.join(cfg.logging.run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]
