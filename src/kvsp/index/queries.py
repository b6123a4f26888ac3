"""Decoding of ``POST lookup`` bodies, the Index Service's hottest route.

``LookupRequest.parse`` checks every block key against a pattern: about 13 us for 64 keys, more
than the rest of a lookup. A body is decoded here instead: msgspec checks its structure and the
lengths of the compat and scope ids (the compiled ``is_hex`` their digits) and leaves the block
keys as raw JSON, which the compiled ``pack_keys`` turns straight into the table's packed form
(no string per key, nothing parsed twice); keys it does not take as they are (escapes, anything
malformed) are decoded the slow way, which names what is wrong. The rules are
``LookupRequest``'s: tests/index/test_queries.py holds the two to the same answers on generated
bodies. A body naming ``targets`` goes through ``LookupRequest`` itself, which checks URLs; that
lookup computes estimates and is not the cheap one anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal, NamedTuple, Protocol

import msgspec

from kvsp.core.problems import RecordError
from kvsp.core.records import MAX_KEYS_PER_REQUEST, LookupRequest
from kvsp.index.keytable import check_keys, is_hex, pack_keys
from kvsp.index.wire import PackedKeys

__all__ = ["Lookup", "LookupBody", "LookupQuery", "decode_lookup"]


class LookupQuery(Protocol):
    """What a lookup needs: ``LookupRequest`` or ``Lookup``."""

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

    @property
    def answer(self) -> Literal["holders"] | None: ...


def _hex(digits: int) -> msgspec.Meta:
    """A fixed length here; the digits are checked by ``is_hex`` (msgspec's patterns run
    Python's ``re``, about 0.5 us each)."""
    return msgspec.Meta(min_length=digits, max_length=digits)


class LookupBody(msgspec.Struct, frozen=True):
    """A lookup body as msgspec decodes it, the keys left as raw JSON; unknown members are
    ignored, as records do."""

    scope_id: Annotated[str, _hex(32)]
    compat_id: Annotated[str, _hex(64)]
    block_keys: msgspec.Raw
    targets: list[str] | None = None
    block_tokens: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] | None = None
    answer: Literal["holders"] | None = None


class Lookup(NamedTuple):
    """A decoded lookup without targets, its keys packed."""

    scope_id: str
    compat_id: str
    block_keys: PackedKeys
    block_tokens: int | None
    answer: Literal["holders"] | None
    targets: None = None


_DECODER = msgspec.json.Decoder(LookupBody)
_KEY_LIST = msgspec.json.Decoder(
    Annotated[list[str], msgspec.Meta(max_length=MAX_KEYS_PER_REQUEST)]
)


def _packed(block_keys: msgspec.Raw) -> bytes:
    packed = pack_keys(block_keys)
    if packed is None:  # not a plain array of distinct keys: decoded the slow way, which says why
        keys = _KEY_LIST.decode(block_keys)
        check_keys(keys)
        packed = b"".join(map(bytes.fromhex, keys))
        if len(set(keys)) != len(keys):
            raise ValueError("a key appears twice: a chain of Block Keys never repeats one")
    if len(packed) > 32 * MAX_KEYS_PER_REQUEST:
        raise ValueError(f"a lookup names at most {MAX_KEYS_PER_REQUEST} block keys")
    return packed


def decode_lookup(body: bytes) -> LookupQuery:
    """The lookup a body asks for; a body ``LookupRequest`` would refuse is a ``RecordError``."""
    try:
        doc = _DECODER.decode(body)
        if doc.targets is not None:  # the model checks the whole body, URLs included
            return LookupRequest.parse(body)
        if not (is_hex(doc.scope_id) and is_hex(doc.compat_id)):
            raise ValueError("scope_id and compat_id must be lowercase hex digits")
        packed = _packed(doc.block_keys)
    except (msgspec.DecodeError, ValueError) as exc:  # ValidationError is a DecodeError
        raise RecordError(f"LookupRequest: {exc}") from None
    except RecursionError:
        raise RecordError("LookupRequest: nested too deeply") from None
    return Lookup(doc.scope_id, doc.compat_id, PackedKeys(packed), doc.block_tokens, doc.answer)
