"""Configuration: the YAML schema, its validation and its normalised, hashable form."""

from extproc.config.loader import load_config, parse_config
from extproc.config.schema import (
    Config,
    ConfigError,
    LimitRule,
    LimitSpec,
    ModelSpec,
    PlanSpec,
    PriceSpec,
    TenantSpec,
    WindowSpec,
)

__all__ = [
    "Config",
    "ConfigError",
    "LimitRule",
    "LimitSpec",
    "ModelSpec",
    "PlanSpec",
    "PriceSpec",
    "TenantSpec",
    "WindowSpec",
    "load_config",
    "parse_config",
]
