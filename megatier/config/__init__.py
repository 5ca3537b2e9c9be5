"""Configuration: schemas (one dataclass per group), validation, and composing a run's config.

    schema                 dataclasses of every group, ConfigError
    keys                   override keys checked against the schema (an unknown key names the closest)
    validation             validate(cfg, world_size): cross-field checks of every group but checkpoint's (those
                           live beside the checkpoint code: megatier.checkpoint.policy.rules)
    fast_path_validation   what the GPU fast paths need
    compose                compose_config (the trainer's and every script's), register_configs, split_overrides
    fingerprint            the settings that shape the training state, recorded with every checkpoint unit
"""
from megatier.config.compose import compose_config, register_configs, split_overrides
from megatier.config.schema import (CheckFreeConfig, CheckpointConfig, Config, ConfigError, DataConfig,
                                    DiffStreamConfig, LocalTierConfig, LoggingConfig, ModelConfig, OptimConfig,
                                    ParallelConfig, PeerTierConfig, RecoveryConfig, ReliabilityConfig, RemoteTierConfig,
                                    TrainConfig, WandbConfig)
from megatier.config.validation import validate

__all__ = [
    "CheckFreeConfig", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "DiffStreamConfig",
    "LocalTierConfig", "LoggingConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "PeerTierConfig",
    "RecoveryConfig", "ReliabilityConfig", "RemoteTierConfig", "TrainConfig", "WandbConfig", "compose_config",
    "register_configs", "split_overrides", "validate",
]
