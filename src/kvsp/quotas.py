"""What each tenant (scope) may use of a service, so that one tenant can never take another's
room: stored octets at a holder, leased octets and leases at a holder, pinned octets at an
instance, records at the Index Service.

Quotas are configured per tenant in the tenants file (``[quota]`` for every tenant,
``[tenants.NAME.quota]`` for one). Holders and the IS never read the tenants file (it holds the
scope keys); they read its public projection, keyed by Scope ID, which ``kvsp tenants quotas``
writes (``kvsp up`` does it for its cluster)::

    [quota]                      # every scope; absent: the service's own default
    leased_octets = "256M"
    [scopes.<hex16 scope id>]    # one scope
    stored_octets = "1G"
    pinned_octets = "64M"

A value is an integer or a size with K, M, G or T (powers of 1024). A quota the service does
not configure falls back to the service's default (a fair share of its capacity, say which in
docs/operations.md). Sans-IO: parsing and lookup only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from kvsp.core.config import config_table, load_toml
from kvsp.core.ids import HEX16_PATTERN
from kvsp.core.problems import ConfigurationError

__all__ = ["Quota", "Quotas", "parse_octets", "parse_quota"]

_SIZE = re.compile(r"([0-9]+)\s*([KMGT]?)i?B?", re.IGNORECASE)
_SCOPE = re.compile(HEX16_PATTERN)
#: quotas counted in octets (written as sizes); the others are counts
_OCTETS = ("stored_octets", "leased_octets", "pinned_octets")


@dataclass(frozen=True, slots=True)
class Quota:
    """One scope's limits at one service; None: the service's default applies."""

    #: octets of blocks a holder (or an instance's store) keeps for the scope, all tiers
    stored_octets: int | None = None
    #: octets of the scope's blocks under valid leases at a holder
    leased_octets: int | None = None
    #: valid leases of the scope at a holder
    leases: int | None = None
    #: the longest TTL one lease of the scope may ask for at a holder, in milliseconds
    lease_ttl_ms: int | None = None
    #: octets of the scope's blocks pinned by hints at an instance
    pinned_octets: int | None = None
    #: Replica Records of the scope at the Index Service
    records: int | None = None

    def over(self, base: Quota) -> Quota:
        """This quota, with ``base``'s value where this one has none."""
        mine = {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}
        return replace(base, **mine)

    def to_toml(self) -> str:
        return "".join(
            f"{f.name} = {value}\n"
            for f in fields(self)
            if (value := getattr(self, f.name)) is not None
        )


def parse_octets(text: str) -> int:
    """An octet count: an integer, optionally with K, M, G or T (powers of 1024)."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise ConfigurationError(f"{text!r} is not a size (e.g. 1048576, 512M, 4G)")
    return int(match[1]) << (10 * " KMGT".index(match[2].upper() or " "))


def _value(name: str, value: Any, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str) and name in _OCTETS:
        return parse_octets(value)
    raise ConfigurationError(f"{where}: {name} = {value!r} is not a non-negative count or size")


def parse_quota(table: Any, where: str) -> Quota:
    """A ``Quota`` from a TOML table (``where`` names it in errors)."""
    config_table(table, where, [f.name for f in fields(Quota)])
    return Quota(**{name: _value(name, v, where) for name, v in table.items()})


class Quotas:
    """Every scope's quotas at a service: a default for all, and per scope."""

    def __init__(self, default: Quota | None = None, scopes: Mapping[str, Quota] | None = None):
        self.default = default or Quota()
        self._scopes = {s: q.over(self.default) for s, q in (scopes or {}).items()}

    def of(self, scope_id: str) -> Quota:
        return self._scopes.get(scope_id, self.default)

    def limit(self, scope_id: str, name: str, fallback: int) -> int:
        """Quota ``name`` of ``scope_id``, or the service's ``fallback`` where none is set."""
        value: int | None = getattr(self.of(scope_id), name)
        return fallback if value is None else value

    @classmethod
    def parse(cls, text: str) -> Quotas:
        doc = config_table(load_toml(text, "quotas file"), "quotas file", ("quota", "scopes"))
        scopes = doc.get("scopes", {})
        if not isinstance(scopes, dict):
            raise ConfigurationError("quotas file: [scopes.ID] tables")
        for scope in scopes:
            if _SCOPE.fullmatch(scope) is None:
                raise ConfigurationError(f"quotas file: {scope!r} is not a hex16 Scope ID")
        return cls(
            parse_quota(doc.get("quota", {}), "[quota]"),
            {s: parse_quota(t, f"[scopes.{s}]") for s, t in scopes.items()},
        )

    @classmethod
    def load(cls, path: Path | str | None) -> Quotas:
        """The quotas file at ``path``; no file: no quota beyond the service's defaults."""
        if path is None:
            return cls()
        try:
            return cls.parse(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigurationError(f"cannot read quotas file {path}: {exc.strerror}") from None

    def to_toml(self) -> str:
        """The quotas file of these quotas (no secret in it: scopes are named by ID)."""
        parts = [f"[quota]\n{self.default.to_toml()}"]
        parts += [f"\n[scopes.{s}]\n{q.to_toml()}" for s, q in sorted(self._scopes.items())]
        return "".join(parts)
