"""`ConfigError` and the value checks that raise it, shared by the config readers and the methods' options."""

from __future__ import annotations

from pathlib import Path


class ConfigError(ValueError):
    """A configuration the user must fix; the message names the key."""


def int_at_least(value, key: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


def flag(value, key: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    return value


def resolve_path(value: str, base: Path) -> str:
    """Relative paths in a config file are relative to the file; names like gemma-3-270m stay names."""
    candidate = base / value
    return str(candidate) if not Path(value).is_absolute() and candidate.exists() else value
