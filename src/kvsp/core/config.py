"""Reading kvsp's TOML configuration files (principals, tenants, quotas, scenarios) the same way:
one ``ConfigurationError`` that names the file or table at fault. Pure."""

from __future__ import annotations

import tomllib
from collections.abc import Collection
from typing import Any

from kvsp.core.problems import ConfigurationError

__all__ = ["config_table", "load_toml"]


def load_toml(text: str, what: str) -> dict[str, Any]:
    """The TOML document ``text`` of the ``what`` file."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"{what} is not TOML: {exc}") from None


def config_table(entry: Any, where: str, allowed: Collection[str]) -> dict[str, Any]:
    """``entry`` as a table whose keys are all in ``allowed`` (``where`` names it in errors)."""
    if not isinstance(entry, dict):
        raise ConfigurationError(f"{where} must be a table")
    unknown = sorted(set(entry) - set(allowed))
    if unknown:
        raise ConfigurationError(f"{where}: unknown keys {', '.join(unknown)}")
    return entry
