"""Configuration: the YAML schema, its validation and its normalised, hashable form."""

from extproc.config.loader import load_config, parse_config
from extproc.config.schema import (
    Config,
    ConfigError,
    LimitSpec,
    ModelSpec,
    PlanSpec,
    TenantSpec,
)

__all__ = [
    "Config",
    "ConfigError",
    "LimitSpec",
    "ModelSpec",
    "PlanSpec",
    "TenantSpec",
    "load_config",
    "parse_config",
]
