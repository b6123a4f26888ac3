"""The controller's tenants file: which scope key each tenant's blocks are keyed with.

Scope keys are secrets (whoever has one can name, and so look up, the tenant's blocks); only the
controller and instances read this file, and no key is ever logged or shown (``repr`` omits it)::

    [tenants.acme]
    scope_key = "<hex, at least 32 octets>"
    api_keys_sha256 = ["<hex SHA-256 of an API key of the front end>"]
    compat_ids = ["<hex32>"]             # the cache configurations the tenant may use
    [tenants.acme.quota]                 # optional: this tenant's quotas (kvsp.quotas)
    stored_octets = "1G"

    [quota]                              # optional: every tenant's quotas

``kvsp tenants quotas FILE`` prints the quotas keyed by Scope ID (no key in it), for holders and
the Index Service, which never read this file.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import tomllib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsp.auth import Principal
from kvsp.core.ids import HEX32_PATTERN
from kvsp.core.keys import scope_id
from kvsp.core.problems import ConfigurationError, Forbidden, NotFound
from kvsp.quotas import Quotas, parse_quota

__all__ = ["Tenant", "Tenants"]

_HEX = re.compile(r"(?:[0-9a-f]{2})+")
_HEX32 = re.compile(HEX32_PATTERN)
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class Tenant:
    name: str
    scope_key: bytes = field(repr=False)
    scope_id: str
    compat_ids: frozenset[str]
    api_keys_sha256: frozenset[str] = field(repr=False, default=frozenset())

    def check_compat(self, compat_id: str) -> None:
        if compat_id not in self.compat_ids:
            raise Forbidden(f"tenant {self.name!r} may not use compatibility {compat_id}")


def _tenant(name: str, entry: Any) -> Tenant:
    if not isinstance(entry, dict):
        raise ConfigurationError(f"tenant {name!r} must be a table")
    key = entry.get("scope_key")
    if not isinstance(key, str) or _HEX.fullmatch(key) is None or len(key) < 64:
        raise ConfigurationError(f"tenant {name!r}: scope_key must be hex of >= 32 octets")
    compat = entry.get("compat_ids", [])
    if not isinstance(compat, list) or not all(
        isinstance(c, str) and _HEX32.fullmatch(c) for c in compat
    ):
        raise ConfigurationError(f"tenant {name!r}: compat_ids must be hex32 strings")
    api = entry.get("api_keys_sha256", [])
    if not isinstance(api, list) or not all(
        isinstance(a, str) and _HEX64.fullmatch(a) for a in api
    ):
        raise ConfigurationError(f"tenant {name!r}: api_keys_sha256 must be hex SHA-256 values")
    octets = bytes.fromhex(key)
    return Tenant(name, octets, scope_id(octets).hex(), frozenset(compat), frozenset(api))


class Tenants:
    def __init__(self, tenants: Mapping[str, Tenant], quotas: Quotas | None = None) -> None:
        self._tenants = dict(tenants)
        #: each tenant's quotas, by Scope ID
        self.quotas = quotas or Quotas()
        scopes = [t.scope_id for t in tenants.values()]
        if len(set(scopes)) != len(scopes):
            raise ConfigurationError("two tenants share a scope key")

    @classmethod
    def parse(cls, text: str) -> Tenants:
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigurationError(f"tenants file is not TOML: {exc}") from None
        tables = doc.get("tenants")
        if not isinstance(tables, dict) or not tables:
            raise ConfigurationError("tenants file needs at least one [tenants.NAME] table")
        tenants = {name: _tenant(name, entry) for name, entry in tables.items()}
        quotas = Quotas(
            parse_quota(doc.get("quota", {}), "[quota]"),
            {
                tenants[name].scope_id: parse_quota(entry["quota"], f"[tenants.{name}.quota]")
                for name, entry in tables.items()
                if "quota" in entry
            },
        )
        return cls(tenants, quotas)

    @classmethod
    def load(cls, path: Path | str) -> Tenants:
        try:
            return cls.parse(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigurationError(f"cannot read tenants file {path}: {exc.strerror}") from None

    def get(self, name: str) -> Tenant:
        found = self._tenants.get(name)
        if found is None:
            raise NotFound(f"no tenant {name!r}")
        return found

    def for_principal(self, principal: Principal, name: str) -> Tenant:
        """The tenant ``name``, if ``principal`` may act in its scope; ``Forbidden`` otherwise,
        and the same for a name no tenant has (tenant names are not revealed)."""
        found = self._tenants.get(name)
        if found is None or not principal.may_access_scope(found.scope_id):
            raise Forbidden(f"principal {principal.name!r} may not act for tenant {name!r}")
        return found

    def by_api_key(self, key: str) -> Tenant | None:
        """The tenant an API key belongs to (compared as SHA-256, in constant time)."""
        digest = hashlib.sha256(key.encode()).hexdigest()
        found = None
        for tenant in self._tenants.values():
            for known in tenant.api_keys_sha256:
                if hmac.compare_digest(known, digest):
                    found = tenant
        return found

    def __iter__(self) -> Iterator[Tenant]:
        return iter(self._tenants.values())
