"""Typed run configurations: frozen dataclass sections, YAML presets and ``key=value`` overrides.

Importing this package needs only the standard library and PyYAML (no torch, no ray).
"""

from __future__ import annotations

from rlhf.config.cli import describe_keys, parse_cli
from rlhf.config.loader import available_presets, config_to_dict, load_config, save_config
from rlhf.config.schema import (
    ConfigError,
    DataConfig,
    DPOConfig,
    DPORunConfig,
    LoggingConfig,
    ModelConfig,
    RayConfig,
    RewardModelConfig,
    RewardModelRunConfig,
    RunConfig,
    SFTRunConfig,
    StrategyConfig,
    TrainConfig,
)

__all__ = [
    "ConfigError",
    "DataConfig",
    "DPOConfig",
    "DPORunConfig",
    "LoggingConfig",
    "ModelConfig",
    "RayConfig",
    "RewardModelConfig",
    "RewardModelRunConfig",
    "RunConfig",
    "SFTRunConfig",
    "StrategyConfig",
    "TrainConfig",
    "available_presets",
    "config_to_dict",
    "describe_keys",
    "load_config",
    "parse_cli",
    "save_config",
]
