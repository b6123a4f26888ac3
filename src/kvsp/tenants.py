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

    [shared.system-prompt]               # a public prefix some tenants share (KVSP 4.2)
    scope_key = "<hex, at least 32 octets>"
    tenants = ["acme", "globex"]
    prefix_tokens = [1, 2, 3]            # or prefix_system = "<a chat's system prompt>"

``kvsp tenants quotas FILE`` prints the quotas keyed by Scope ID (no key in it), for holders and
the Index Service, which never read this file.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvsp.auth import Principal
from kvsp.core.config import config_table, load_toml
from kvsp.core.ids import HEX32_PATTERN, parse_block_key, parse_compat_id
from kvsp.core.keys import ROOT_PARENT, scope_id
from kvsp.core.problems import ConfigurationError, Forbidden, NotFound
from kvsp.core.shared import ScopedChain, SharedScope, shared_blocks
from kvsp.quotas import Quotas, parse_quota

__all__ = ["Tenant", "Tenants", "Tokenize"]

#: text to token ids, with the model's tokenizer
Tokenize = Callable[[str], Sequence[int]]

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
    #: the shared scopes (public prefixes) this tenant may use
    shared: tuple[SharedScope, ...] = ()

    def chain(self, compat_id: str, block_tokens: int) -> ScopedChain:
        """The Block Key chain of a new prompt of this tenant."""
        return ScopedChain(
            self.scope_key, self.scope_id, parse_compat_id(compat_id), block_tokens, self.shared
        )

    def chain_after(
        self, compat_id: str, block_tokens: int, prompt_blocks: Sequence[str]
    ) -> ScopedChain:
        """The chain after ``prompt_blocks`` (a checkpoint's), which knows which of them are
        a shared prefix's (a shared block is known by its key)."""
        compat = parse_compat_id(compat_id)
        shared, count = shared_blocks(self.shared, prompt_blocks, compat, block_tokens)
        parent = parse_block_key(prompt_blocks[-1]) if prompt_blocks else ROOT_PARENT
        return ScopedChain(
            self.scope_key, self.scope_id, compat, block_tokens, self.shared, parent=parent,
            blocks=len(prompt_blocks), shared=shared, shared_count=count,
        )  # fmt: skip

    def scopes(self) -> list[str]:
        """Every scope this tenant's blocks may be in: its own, then its shared ones."""
        return [self.scope_id, *(s.scope_id for s in self.shared)]

    def check_compat(self, compat_id: str) -> None:
        if compat_id not in self.compat_ids:
            raise Forbidden(f"tenant {self.name!r} may not use compatibility {compat_id}")


def _scope_key(entry: dict[str, Any], where: str) -> bytes:
    key = entry.get("scope_key")
    if not isinstance(key, str) or _HEX.fullmatch(key) is None or len(key) < 64:
        raise ConfigurationError(f"{where}: scope_key must be hex of >= 32 octets")
    return bytes.fromhex(key)


def _tenant(name: str, entry: Any) -> Tenant:
    where = f"tenant {name!r}"
    config_table(entry, where, ("scope_key", "compat_ids", "api_keys_sha256", "quota"))
    octets = _scope_key(entry, where)
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
    return Tenant(name, octets, scope_id(octets).hex(), frozenset(compat), frozenset(api))


def _shared(name: str, entry: Any, tokenize: Tokenize | None) -> tuple[SharedScope, list[str]]:
    where = f"shared scope {name!r}"
    config_table(entry, where, ("scope_key", "tenants", "prefix_tokens", "prefix_system"))
    octets = _scope_key(entry, where)
    allowed = entry.get("tenants")
    if not isinstance(allowed, list) or not allowed or not all(isinstance(t, str) for t in allowed):
        raise ConfigurationError(f"shared scope {name!r}: tenants must list tenant names")
    tokens, text = entry.get("prefix_tokens"), entry.get("prefix_system")
    if (tokens is None) == (text is None):
        raise ConfigurationError(f"shared scope {name!r}: give prefix_tokens or prefix_system")
    if text is not None:
        if not isinstance(text, str) or not text:
            raise ConfigurationError(f"shared scope {name!r}: prefix_system must be text")
        if tokenize is None:
            raise ConfigurationError(
                f"shared scope {name!r}: prefix_system needs the model's tokenizer here; "
                "give prefix_tokens"
            )
        tokens = list(tokenize(text))
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in tokens
    ):
        raise ConfigurationError(f"shared scope {name!r}: prefix_tokens must be token ids")
    return SharedScope(name, octets, scope_id(octets).hex(), tuple(tokens)), allowed


class Tenants:
    def __init__(self, tenants: Mapping[str, Tenant], quotas: Quotas | None = None) -> None:
        self._tenants = dict(tenants)
        #: each tenant's quotas, by Scope ID
        self.quotas = quotas or Quotas()
        scopes = [t.scope_id for t in tenants.values()]
        shared = {s.scope_id for t in tenants.values() for s in t.shared}
        if len(set(scopes)) != len(scopes) or not shared.isdisjoint(scopes):
            raise ConfigurationError("two tenants (or a tenant and a shared scope) share a key")

    @classmethod
    def parse(cls, text: str, tokenize: Tokenize | None = None) -> Tenants:
        """The tenants of ``text``; ``tokenize`` turns a chat's system prompt into the tokens a
        conversation with it begins with (``kvsp.model.system_prefix``), needed only
        where a shared scope gives ``prefix_system``."""
        doc = load_toml(text, "tenants file")
        tables = doc.get("tenants")
        if not isinstance(tables, dict) or not tables:
            raise ConfigurationError("tenants file needs at least one [tenants.NAME] table")
        tenants = {name: _tenant(name, entry) for name, entry in tables.items()}
        shared = doc.get("shared", {})
        if not isinstance(shared, dict):
            raise ConfigurationError("tenants file: [shared.NAME] tables")
        for name, entry in shared.items():
            scope, allowed = _shared(name, entry, tokenize)
            for tenant in allowed:
                if tenant not in tenants:
                    raise ConfigurationError(f"shared scope {name!r}: no tenant {tenant!r}")
                before = tenants[tenant]
                tenants[tenant] = replace(before, shared=(*before.shared, scope))
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
    def load(cls, path: Path | str, tokenize: Tokenize | None = None) -> Tenants:
        try:
            return cls.parse(Path(path).read_text(encoding="utf-8"), tokenize)
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

    def by_scope(self, scope_id: str) -> Tenant | None:
        """The tenant whose own scope is ``scope_id`` (a checkpoint names its session's)."""
        return next((t for t in self._tenants.values() if t.scope_id == scope_id), None)

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
