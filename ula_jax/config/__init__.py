"""Experiment configuration: one typed schema, YAML building blocks, dotted overrides.

``load_config(path, overrides)`` composes and validates an experiment;
``config_to_yaml(cfg)`` writes the resolved config back out.
"""

from __future__ import annotations

from ula_jax.config.errors import ConfigError
from ula_jax.config.loader import (check_devices, compose, config_to_yaml, load_config,
                                   parse_overrides, parse_value, split_override, validate)
from ula_jax.config.schema import (BLOCK_SECTIONS, EngineConfig, ExperimentConfig,
                                   ExperimentInfo, FarTierConfig, HiSparseConfig,
                                   KernelsConfig, MemoryConfig, MeshConfig, ModelConfig,
                                   WorkloadConfig, scaled_range)

__all__ = [
    "BLOCK_SECTIONS", "ConfigError", "EngineConfig", "ExperimentConfig", "ExperimentInfo",
    "FarTierConfig", "HiSparseConfig", "KernelsConfig", "MemoryConfig", "MeshConfig",
    "ModelConfig", "WorkloadConfig", "check_devices", "compose", "config_to_yaml",
    "load_config", "parse_overrides", "parse_value", "scaled_range", "split_override",
    "validate",
]
