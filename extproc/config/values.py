"""The scalar checks of the configuration: each returns the value or raises ``ConfigError``
naming the field (``plans.free.batch_tokens: must be an integer >= 1, got 0``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from extproc.config.schema import ConfigError

_Choice = TypeVar("_Choice", bound=str)


def mapping(value: Any, path: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(path, f"must be a mapping, got {type(value).__name__}")
    return value


def known(doc: Mapping[str, Any], allowed: set[str], path: str) -> None:
    """Every key of ``doc`` is one of ``allowed``."""
    for key in doc:
        if key not in allowed:
            raise ConfigError(f"{path}.{key}" if path else str(key), "unknown field")


def optional_integer(value: Any, path: str, *, minimum: int = 1) -> int | None:
    return None if value is None else integer(value, path, minimum=minimum)


def integer(value: Any, path: str, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(path, f"must be an integer >= {minimum}, got {value!r}")
    return value


def number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(path, f"must be a positive number, got {value!r}")
    return float(value)


def non_negative(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e9:
        raise ConfigError(path, f"must be a number >= 0, got {value!r}")
    return float(value)


def fraction(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ConfigError(path, f"must be a number in (0, 1], got {value!r}")
    return float(value)


def secret(doc: dict[str, Any], env_key: str, file_key: str) -> str | None:
    """A secret read at load time from an environment variable or a file (one of them)."""
    env, file = doc.get(env_key), doc.get(file_key)
    if env is not None and file is not None:
        raise ConfigError(env_key, f"set {env_key} or {file_key}, not both")
    if env is not None:
        name = string(env, env_key)
        secret = os.environ.get(name, "")
        if not secret:
            raise ConfigError(env_key, f"environment variable {name} is unset or empty")
        return secret
    if file is None:
        return None
    where = string(file, file_key)
    try:
        secret = Path(where).read_text().strip()
    except OSError as exc:
        raise ConfigError(file_key, f"cannot read {where}: {exc.strerror}") from exc
    if not secret:
        raise ConfigError(file_key, f"{where} is empty")
    if any(c in secret for c in "\r\n\0"):
        raise ConfigError(file_key, "the secret holds a line break or NUL")
    return secret


def readable(value: Any, path: str) -> str:
    where = string(value, path)
    try:
        with open(where, "rb"):
            pass
    except OSError as exc:
        raise ConfigError(path, f"cannot read {where}: {exc.strerror}") from exc
    return where


def seconds(value: Any, path: str, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ConfigError(path, f"must be seconds in [{low:g}, {high:g}], got {value!r}")
    return float(value)


def choice(value: object, path: str, choices: tuple[_Choice, ...]) -> _Choice:
    """``value``, one of ``choices``, typed as them (a ``Literal`` where the caller wants one)."""
    if value not in choices:
        raise ConfigError(path, f"must be one of {', '.join(choices)}, got {value!r}")
    return choices[choices.index(value)]  # the equal choice: value typed as the choices


def string(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(path, f"must be a non-empty string, got {value!r}")
    return value


def boolean(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(path, "must be true or false")
    return value
