"""Who may do what: principals, bearer tokens, and the one ``authorize`` every service calls.

Every service reads the same principals file (TOML, ``--auth FILE``)::

    [principals.holder-1]
    token_sha256 = "<hex SHA-256 of the token>"   # tokens are never stored in clear
    roles = ["holder"]          # holder | instance | controller | client | metrics | admin
    holders = ["http://127.0.0.1:9101/kvsp/"]       # holder URLs it may publish for ("*": any)
    scopes = ["<hex16 scope id>"]                   # or ["*"] for every scope

An unknown or missing token is ``Unauthenticated`` (401); a known principal acting outside its
roles, scopes or holders is ``Forbidden`` (403). ``admin`` passes every role check but is still
bound by its scopes and holders. Without a principals file a service runs in development mode:
it binds to loopback and treats every request as an all-powerful development principal.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kvsp.core.config import config_table, load_toml
from kvsp.core.ids import HEX16_PATTERN
from kvsp.core.problems import ConfigurationError, Forbidden, Unauthenticated
from kvsp.core.records import MOQT_PUBLISHER, decode_moqt_namespace
from kvsp.core.urls import canonical_url

__all__ = [
    "ANY",
    "DEVELOPMENT",
    "Principal",
    "Principals",
    "Role",
    "authorize",
    "token_sha256",
]

ANY = "*"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_SCOPE = re.compile(HEX16_PATTERN)


class Role(StrEnum):
    HOLDER = "holder"
    INSTANCE = "instance"
    CONTROLLER = "controller"
    CLIENT = "client"
    #: a front end on its own (``kvsp frontend serve``): places requests for its tenants and
    #: streams them, naming sessions as the controller named them (decision 0019)
    FRONTEND = "frontend"
    #: reads ``GET metrics`` (which names scopes and principals), nothing else
    METRICS = "metrics"
    #: asks the controller where a prompt's prefix is cached (``POST query``), nothing else
    ROUTER = "router"
    #: publishes the records of the vLLM pods it reads KV events from (``kvsp index ingest``)
    INGEST = "ingest"
    ADMIN = "admin"


def token_sha256(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


@dataclass(frozen=True, slots=True)
class Principal:
    name: str
    roles: frozenset[Role]
    scopes: frozenset[str]
    holders: frozenset[str]

    def has_any_role(self, roles: tuple[Role, ...]) -> bool:
        return Role.ADMIN in self.roles or not self.roles.isdisjoint(roles)

    def may_access_scope(self, scope_id: str) -> bool:
        return ANY in self.scopes or scope_id in self.scopes

    def may_act_for(self, holder: str) -> bool:
        """``holder``: a holder URL, or a MOQT namespace's publisher (``replica_holder``)."""
        if ANY in self.holders:
            return True
        return (
            holder if holder.startswith(MOQT_PUBLISHER) else canonical_url(holder)
        ) in self.holders


DEVELOPMENT = Principal(
    name="development",
    roles=frozenset(Role),
    scopes=frozenset({ANY}),
    holders=frozenset({ANY}),
)


def authorize(
    principal: Principal,
    roles: Role | Iterable[Role],
    scope: str | None = None,
    holder: str | None = None,
) -> None:
    """Raise ``Forbidden`` unless ``principal`` has one of ``roles`` and, where given, access
    to ``scope`` (hex16 Scope ID) and the right to act for ``holder``."""
    wanted = (roles,) if isinstance(roles, Role) else tuple(roles)
    if not principal.has_any_role(wanted):
        names = " or ".join(r.value for r in wanted)
        raise Forbidden(f"principal {principal.name!r} lacks the role {names}")
    if scope is not None and not principal.may_access_scope(scope):
        raise Forbidden(f"principal {principal.name!r} is not authorized for scope {scope}")
    if holder is not None and not principal.may_act_for(holder):
        raise Forbidden(f"principal {principal.name!r} may not act for holder {holder}")


def _holder(holder: str, name: str) -> str:
    """A ``holders`` entry: ``*``, an http(s) holder URL, or ``moqt-namespace:<namespace>``
    for the publisher of a MOQT namespace (KVSP 4.4: the relay's URI authorizes nobody)."""
    if holder == ANY:
        return holder
    if holder.startswith(MOQT_PUBLISHER):
        try:
            decode_moqt_namespace(holder.removeprefix(MOQT_PUBLISHER))
        except ValueError as exc:
            raise ConfigurationError(f"principal {name!r}: holder {holder!r}: {exc}") from None
        return holder
    if urlsplit(holder).scheme not in ("http", "https"):
        raise ConfigurationError(
            f"principal {name!r}: holder {holder!r} is not an http(s) URL or "
            f"{MOQT_PUBLISHER}<namespace> (a moqt holder is authorized by its namespace)"
        )
    return canonical_url(holder)


def _strings(entry: Mapping[str, Any], key: str, name: str) -> list[str]:
    value = entry.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigurationError(f"principal {name!r}: {key} must be a list of strings")
    return value


def _principal(name: str, entry: Any) -> tuple[str, Principal]:
    config_table(entry, f"principal {name!r}", ("token_sha256", "roles", "holders", "scopes"))
    digest = entry.get("token_sha256")
    if not isinstance(digest, str) or _HEX64.fullmatch(digest) is None:
        raise ConfigurationError(
            f"principal {name!r}: token_sha256 must be 64 lowercase hex digits"
        )
    try:
        roles = frozenset(Role(r) for r in _strings(entry, "roles", name))
    except ValueError as exc:
        raise ConfigurationError(f"principal {name!r}: {exc}") from None
    if not roles:
        raise ConfigurationError(f"principal {name!r} needs at least one role")
    scopes = _strings(entry, "scopes", name)
    for scope in scopes:
        if scope != ANY and _SCOPE.fullmatch(scope) is None:
            raise ConfigurationError(f"principal {name!r}: scope {scope!r} is not a hex16 Scope ID")
    holders = [_holder(holder, name) for holder in _strings(entry, "holders", name)]
    return digest, Principal(name, roles, frozenset(scopes), frozenset(holders))


class Principals:
    """The principals of a deployment, indexed by token hash."""

    def __init__(self, by_token_hash: Mapping[str, Principal], development: bool = False) -> None:
        self._by_hash = dict(by_token_hash)
        self.development = development

    @classmethod
    def development_mode(cls) -> Principals:
        return cls({}, development=True)

    @classmethod
    def parse(cls, text: str) -> Principals:
        doc = load_toml(text, "principals file")
        table = doc.get("principals")
        if not isinstance(table, dict) or not table:
            raise ConfigurationError("principals file needs a non-empty [principals] table")
        by_hash: dict[str, Principal] = {}
        for name, entry in table.items():
            digest, principal = _principal(name, entry)
            if digest in by_hash:
                raise ConfigurationError(
                    f"principals {by_hash[digest].name!r} and {name!r} share a token"
                )
            by_hash[digest] = principal
        return cls(by_hash)

    @classmethod
    def load(cls, path: Path | str) -> Principals:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigurationError(
                f"cannot read principals file {path}: {exc.strerror}"
            ) from None
        return cls.parse(text)

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal for an ``Authorization`` header value, or ``Unauthenticated``."""
        if self.development:
            return DEVELOPMENT
        if not authorization:
            raise Unauthenticated("missing bearer token")
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthenticated("expected 'Authorization: Bearer <token>'")
        principal = self._by_hash.get(token_sha256(token.strip()))
        if principal is None:
            raise Unauthenticated("unknown token")
        return principal
