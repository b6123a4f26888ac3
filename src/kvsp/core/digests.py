"""RFC 9530 ``Repr-Digest`` fields for block representations (KVSP 6.7).

Holders send ``Repr-Digest: sha-256=:<base64>:`` with every block; clients verify it before
trusting any octet. Parsing goes through ``http_sfv`` so the field is a real Structured Field
Dictionary: the member must be a Byte Sequence (a Token such as ``sha-256=abc`` is rejected, as is
base64 without padding), and ``sha-256`` is required. Other algorithms may appear and are
ignored: kvsp verifies SHA-256 only.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

from http_sfv.dictionary import Dictionary
from http_sfv.item import Item

from kvsp.core.problems import DigestError

__all__ = [
    "REQUIRED_ALGORITHM",
    "parse_repr_digest",
    "repr_digest",
    "repr_digest_of",
    "verify_repr_digest",
]

REQUIRED_ALGORITHM = "sha-256"


def repr_digest(sha256_digest: bytes) -> str:
    """The field value for an already computed SHA-256 of the representation."""
    if len(sha256_digest) != 32:
        raise ValueError("a SHA-256 digest is 32 octets")
    return f"{REQUIRED_ALGORITHM}=:{base64.b64encode(sha256_digest).decode('ascii')}:"


def repr_digest_of(*parts: bytes | bytearray | memoryview) -> str:
    """The field value for a representation given as consecutive buffers."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return repr_digest(h.digest())


def _reasons(exc: BaseException) -> str:
    """The non-empty messages along an exception's cause chain (http_sfv nests them)."""
    found = []
    cause: BaseException | None = exc
    while cause is not None:
        if str(cause):
            found.append(str(cause))
        cause = cause.__cause__
    return ": ".join(found) or type(exc).__name__


def parse_repr_digest(field_value: str) -> bytes:
    """The SHA-256 octets from a ``Repr-Digest`` field value; ``DigestError`` if unusable."""
    parsed = Dictionary()
    try:
        parsed.parse(field_value.encode("ascii"))
    except (ValueError, UnicodeEncodeError) as exc:
        raise DigestError(
            f"Repr-Digest is not a valid Structured Field Dictionary: {_reasons(exc)}"
        ) from None
    member = parsed.get(REQUIRED_ALGORITHM)
    if member is None:
        raise DigestError(f"Repr-Digest has no {REQUIRED_ALGORITHM} member")
    value = member.value if isinstance(member, Item) else None
    if not isinstance(value, bytes):
        raise DigestError(f"Repr-Digest {REQUIRED_ALGORITHM} value must be a Byte Sequence")
    if len(value) != 32:
        raise DigestError(f"Repr-Digest {REQUIRED_ALGORITHM} value has {len(value)} octets, not 32")
    return value


def verify_repr_digest(field_value: str | None, computed_sha256: bytes) -> None:
    """Raise ``DigestError`` unless the field carries exactly ``computed_sha256``."""
    if field_value is None:
        raise DigestError("the response has no Repr-Digest field")
    if not hmac.compare_digest(parse_repr_digest(field_value), computed_sha256):
        raise DigestError("Repr-Digest does not match the received representation")
