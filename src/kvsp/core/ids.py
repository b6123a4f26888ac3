"""Typed identities: raw octets inside kvsp, lowercase hex on the wire.

Block Keys, Compatibility IDs and Scope IDs are hashes. Keeping them as ``bytes`` internally
makes the key chain and the indexes cheap (no hex round trip per block); the ``NewType``s stop a
Scope ID from being passed where a Block Key is expected. ``hex32``/``hex16`` strings are what
records, URLs and the CLI carry.
"""

from __future__ import annotations

import re
import uuid
from typing import NewType

from kvsp.core.problems import KeyMaterialError

__all__ = [
    "HEX16_PATTERN",
    "HEX32_PATTERN",
    "BlockKey",
    "CompatId",
    "ScopeId",
    "parse_block_key",
    "parse_compat_id",
    "parse_scope_id",
    "tenant_session",
]

BlockKey = NewType("BlockKey", bytes)
CompatId = NewType("CompatId", bytes)
ScopeId = NewType("ScopeId", bytes)

HEX32_PATTERN = r"^[0-9a-f]{64}$"
HEX16_PATTERN = r"^[0-9a-f]{32}$"
_HEX = {32: re.compile(HEX32_PATTERN), 16: re.compile(HEX16_PATTERN)}


def _parse_hex(text: str, octets: int, what: str) -> bytes:
    if not isinstance(text, str) or _HEX[octets].fullmatch(text) is None:
        raise KeyMaterialError(
            f"{what} must be {octets * 2} lowercase hex digits, got {text!r:.80}"
        )
    return bytes.fromhex(text)


def parse_block_key(text: str) -> BlockKey:
    return BlockKey(_parse_hex(text, 32, "block key"))


def parse_compat_id(text: str) -> CompatId:
    return CompatId(_parse_hex(text, 32, "compat id"))


def parse_scope_id(text: str) -> ScopeId:
    return ScopeId(_parse_hex(text, 16, "scope id"))


#: the UUID namespace of kvsp's tenant sessions (uuid5 of the DNS name kvsp.session)
_SESSIONS = uuid.uuid5(uuid.NAMESPACE_DNS, "kvsp.session")


def tenant_session(scope_id: str, name: str) -> str:
    """The session UUID of a tenant's session ``name`` (any string its client chose).

    Session ids are namespaced by tenant: two tenants that pick the same name get different
    sessions, so neither can see, block or squat the other's, and the UUID reveals nothing of
    the name. The same tenant and name always give the same UUID (a conversation's later turns
    find its session)."""
    return str(uuid.uuid5(_SESSIONS, f"{scope_id}/{name}"))
