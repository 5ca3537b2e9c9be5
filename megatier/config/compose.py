"""Composing the run's config from the YAML groups and Hydra overrides: the trainer's and every script's.

    cfg = compose_config(["model=tiny", "train.iters=20"])

Overrides use Hydra's grammar (``key=value``, ``group=option``, ``+key=value``, ``~key``). Every problem is one
:class:`ConfigError` line: an unknown key (checked first, with or without ``+``: :mod:`.keys`), a missing
option of a group, a value of the wrong type.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from megatier.config.keys import check_override_keys
from megatier.config.schema import Config, ConfigError


def register_configs() -> None:
    """Register the schemas so YAML in configs/ is validated against them (struct mode)."""
    cs = ConfigStore.instance()
    cs.store(name="megatier_schema", node=Config)


def config_dir() -> str:
    """The config groups: the package's copy (an installed wheel carries configs/ as ``megatier.configs``),
    else configs/ beside the package in a source tree."""
    try:
        spec = importlib.util.find_spec("megatier.configs")  # a folder of YAML: a namespace package
    except ModuleNotFoundError:
        spec = None
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        if os.path.isfile(os.path.join(folder, "config.yaml")):
            return folder
    return os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


def config_groups(directory: Optional[str] = None) -> set[str]:
    """The group names (sub-directories of the config directory: model, parallel, ...)."""
    directory = directory or config_dir()
    return {n for n in os.listdir(directory) if os.path.isdir(os.path.join(directory, n)) and not n.startswith("_")}


def split_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """A script's own arguments and the Hydra overrides after ``--`` (scripts that run training jobs)."""
    if "--" not in argv:
        return list(argv), []
    i = argv.index("--")
    return list(argv[:i]), list(argv[i + 1:])


def _one_line(error: BaseException) -> str:
    """Hydra's and OmegaConf's multi-line messages as one line: the message, then what caused it (the bad
    value's own message), without Hydra's search path."""
    parts = [str(error).split("Config search path")[0]]
    cause = error.__cause__ or error.__context__
    if cause is not None:
        parts.append(str(cause).split("\n")[0])
    text = ": ".join(" ".join(p.replace("\t", " ").split()) for p in parts if p.strip())
    return text.replace("In 'config': ", "")


def compose_config(overrides: list[str], directory: Optional[str] = None) -> Config:
    """The Config of ``overrides``; ConfigError (one line) for anything that does not compose."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    directory = directory or config_dir()
    check_override_keys(list(overrides), config_groups(directory))
    register_configs()
    try:
        with initialize_config_dir(config_dir=directory, version_base="1.3"):
            return OmegaConf.to_object(compose(config_name="config", overrides=list(overrides)))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_one_line(e)) from None
