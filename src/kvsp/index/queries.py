"""Decoding of ``POST lookup`` bodies, the Index Service's hottest route.

``LookupRequest.parse`` checks every block key against a pattern: about 13 us for 64 keys, more
than the rest of a lookup. A body is decoded here instead: msgspec checks its structure and the
compat and scope ids, and the compiled ``check_keys`` the block keys, to the rules of
``LookupRequest`` (tests/index/test_queries.py holds the two to the same answers on generated
bodies). A body naming ``targets`` goes through ``LookupRequest`` itself, which checks URLs;
that lookup computes estimates and is not the cheap one anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Protocol

import msgspec

from kvsp.core.problems import RecordError
from kvsp.core.records import MAX_KEYS_PER_REQUEST, LookupRequest
from kvsp.index._keytable import check_keys

__all__ = ["LookupBody", "LookupQuery", "decode_lookup"]


class LookupQuery(Protocol):
    """What a lookup needs: ``LookupRequest`` or ``LookupBody``."""

    @property
    def scope_id(self) -> str: ...

    @property
    def compat_id(self) -> str: ...

    @property
    def block_keys(self) -> Sequence[str]: ...

    @property
    def targets(self) -> Sequence[str] | None: ...

    @property
    def block_tokens(self) -> int | None: ...


def _hex(digits: int) -> msgspec.Meta:
    # fixed length, so "$" (which also matches before a final newline) cannot let one through
    return msgspec.Meta(min_length=digits, max_length=digits, pattern="^[0-9a-f]+$")


class LookupBody(msgspec.Struct, frozen=True):
    """A lookup body as decoded by msgspec; unknown members are ignored, as records do."""

    scope_id: Annotated[str, _hex(32)]
    compat_id: Annotated[str, _hex(64)]
    block_keys: Annotated[list[str], msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST)]
    targets: list[str] | None = None
    block_tokens: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] | None = None


_DECODER = msgspec.json.Decoder(LookupBody)


def decode_lookup(body: bytes) -> LookupQuery:
    """The lookup a body asks for; a body ``LookupRequest`` would refuse is a ``RecordError``."""
    try:
        query = _DECODER.decode(body)
        check_keys(query.block_keys)
    except (msgspec.DecodeError, ValueError) as exc:  # ValidationError is a DecodeError
        raise RecordError(f"LookupRequest: {exc}") from None
    if query.targets is not None:
        return LookupRequest.parse(body)
    return query
