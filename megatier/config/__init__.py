"""Configuration: schemas (one dataclass per group), validation, and composing a run's config.

    schema                 dataclasses of every group, ConfigError
    validation             validate(cfg, world_size): cross-field checks of every group, before any side effect
    checkpoint_validation  the checkpoint group's rules; the effective config on a given topology
    compose                register_configs (Hydra), compose_config (as pretrain_gpt.py), split_overrides
    fingerprint            the settings that shape the training state, recorded with every checkpoint unit
"""
from megatier.config.checkpoint_validation import (COMPRESSIONS, TIERS, CheckpointConfigWarning,
                                                   check_checkpoint_config, check_remote_url,
                                                   effective_checkpoint_config)
from megatier.config.compose import compose_config, register_configs, split_overrides
from megatier.config.schema import (CheckFreeConfig, CheckpointConfig, Config, ConfigError, DataConfig,
                                    DiffStreamConfig, LocalTierConfig, LoggingConfig, ModelConfig, OptimConfig,
                                    ParallelConfig, PeerTierConfig, RemoteTierConfig, TrainConfig, WandbConfig)
from megatier.config.validation import validate

__all__ = [
    "COMPRESSIONS", "TIERS", "CheckFreeConfig", "CheckpointConfig", "CheckpointConfigWarning", "Config",
    "ConfigError", "DataConfig",
    "DiffStreamConfig", "LocalTierConfig", "LoggingConfig", "ModelConfig", "OptimConfig", "ParallelConfig",
    "PeerTierConfig", "RemoteTierConfig", "TrainConfig", "WandbConfig", "check_checkpoint_config",
    "check_remote_url", "compose_config", "effective_checkpoint_config", "register_configs", "split_overrides",
    "validate",
]
