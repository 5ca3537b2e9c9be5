"""Composing the run's config the way ``pretrain_gpt.py`` does, for scripts and tests."""
from __future__ import annotations

import os
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from megatier.config.schema import Config


def register_configs() -> None:
    """Register the schemas so YAML in configs/ is validated against them (struct mode)."""
    cs = ConfigStore.instance()
    cs.store(name="megatier_schema", node=Config)


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """A script's own arguments and the Hydra overrides after ``--`` (scripts that run pretrain_gpt jobs)."""
    if "--" not in argv:
        return list(argv), []
    i = argv.index("--")
    return list(argv[:i]), list(argv[i + 1:])


def compose_config(overrides: list[str], config_dir: Optional[str] = None) -> Config:
    """The Config ``pretrain_gpt.py <overrides>`` would run with, for scripts that drive or measure it."""
    from hydra import compose, initialize_config_dir

    register_configs()
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    config_dir = config_dir or os.path.join(repo, "configs")
    with initialize_config_dir(config_dir=config_dir, version_base="1.3"):
        return OmegaConf.to_object(compose(config_name="config", overrides=list(overrides)))
