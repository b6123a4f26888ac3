"""Scope IDs and the keyed Block Key chain (KVSP 4.2).

A Block Key names a block together with its whole prefix, and only holders of the scope key can
compute it. The chain is the hot path of every lookup, so it runs on a keyed HMAC template (the
key schedule and the domain prefix are absorbed once per chain) and on token octets converted in
one vectorised step; per block it copies two precomputed SHA-256 states.
"""

from __future__ import annotations

import array
import hashlib
import sys
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvsp.core.ids import BlockKey, CompatId, ScopeId
from kvsp.core.problems import KeyMaterialError

__all__ = [
    "BLOCK_DOMAIN",
    "MIN_SCOPE_KEY_OCTETS",
    "ROOT_PARENT",
    "SCOPE_DOMAIN",
    "BlockKeyChain",
    "HmacTemplate",
    "Tokens",
    "block_keys",
    "scope_id",
    "token_octets",
]

SCOPE_DOMAIN = b"KVSP-SCOPE-1\x00"
BLOCK_DOMAIN = b"KVSP-BLOCK-1\x00"
MIN_SCOPE_KEY_OCTETS = 32
#: K[-1]: the parent of the first block of an unshared chain.
ROOT_PARENT = BlockKey(bytes(32))
#: Blocks of at most this many octets are split by a numpy view (C speed, small objects);
#: larger ones by memoryview slices (no copy of the token octets).
_VIEW_SPLIT_MAX_OCTETS = 256

Tokens = Sequence[int] | npt.NDArray[np.integer]


def _check_scope_key(scope_key: bytes) -> bytes:
    if not isinstance(scope_key, bytes | bytearray | memoryview):
        raise KeyMaterialError("scope key must be octets")
    key = bytes(scope_key)
    if len(key) < MIN_SCOPE_KEY_OCTETS:
        raise KeyMaterialError(
            f"scope key must be at least {MIN_SCOPE_KEY_OCTETS} octets, got {len(key)}"
        )
    return key


_IPAD = bytes(x ^ 0x36 for x in range(256))
_OPAD = bytes(x ^ 0x5C for x in range(256))
_SHA256_BLOCK = 64


class HmacTemplate:
    """HMAC-SHA-256 (RFC 2104) with the key schedule and a message prefix absorbed once.

    Built on hashlib's SHA-256 states rather than the ``hmac`` module: copying two C-level
    hash states per message is cheaper than ``hmac.HMAC.copy()`` and its Python-level
    methods, and the chain calls it once per block.
    """

    __slots__ = ("inner", "outer")

    def __init__(self, key: bytes, prefix: bytes = b"") -> None:
        if len(key) > _SHA256_BLOCK:
            key = hashlib.sha256(key).digest()
        padded = key.ljust(_SHA256_BLOCK, b"\x00")
        self.inner = hashlib.sha256(padded.translate(_IPAD))
        self.inner.update(prefix)
        self.outer = hashlib.sha256(padded.translate(_OPAD))

    def digest(self, *parts: bytes | memoryview) -> bytes:
        """HMAC of ``prefix || parts...``."""
        inner = self.inner.copy()
        for part in parts:
            inner.update(part)
        outer = self.outer.copy()
        outer.update(inner.digest())
        return outer.digest()


def scope_id(scope_key: bytes) -> ScopeId:
    """First 16 octets of SHA-256("KVSP-SCOPE-1" || 0x00 || scope_key)."""
    key = _check_scope_key(scope_key)
    return ScopeId(hashlib.sha256(SCOPE_DOMAIN + key).digest()[:16])


def _range_ok(tokens: npt.NDArray[np.integer]) -> bool:
    """All ids in 0..2^32-1, in one pass: viewed as unsigned of the same width, a negative id
    becomes larger than any id the signed type can hold, so one ``max`` decides."""
    if tokens.size == 0:
        return True
    bits = tokens.dtype.itemsize * 8
    signed = tokens.dtype.kind == "i"
    if not signed and bits <= 32:
        return True
    limit = min(0xFFFFFFFF, (1 << (bits - 1)) - 1 if signed else (1 << bits) - 1)
    unsigned = tokens.view(np.dtype(f"u{tokens.dtype.itemsize}"))
    return int(unsigned.max()) <= limit


def token_octets(tokens: Tokens) -> memoryview:
    """Tokens as uint32 in network byte order; ids outside 0..2^32-1 are an error."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
            raise KeyMaterialError("tokens must be a one-dimensional integer array")
        if not _range_ok(tokens):
            raise KeyMaterialError("token ids must be in 0..2^32-1")
        return tokens.astype(">u4").data.cast("B")
    if isinstance(tokens, str | bytes | bytearray | memoryview):
        raise KeyMaterialError("tokens must be a sequence of integers")
    try:
        packed = array.array("I", tokens)
    except OverflowError:
        raise KeyMaterialError("token ids must be in 0..2^32-1") from None
    except TypeError as exc:
        raise KeyMaterialError(f"token ids must be integers: {exc}") from None
    if packed.itemsize != 4:  # pragma: no cover - every supported platform has a 4-octet "I"
        raise RuntimeError("array('I') is not 32-bit on this platform")
    if sys.byteorder == "little":
        packed.byteswap()
    return memoryview(packed).cast("B")


def _split(octets: memoryview, step: int, count: int) -> list[bytes] | list[memoryview]:
    if step <= _VIEW_SPLIT_MAX_OCTETS:
        chunks: list[bytes] = np.frombuffer(octets, dtype=f"V{step}", count=count).tolist()
        return chunks
    return [octets[o : o + step] for o in range(0, count * step, step)]


class BlockKeyChain:
    """Block Keys of one token sequence, extended as tokens arrive.

    Decode completes blocks one at a time; ``extend`` keeps the tokens after the last complete
    block and never rehashes an earlier block. ``parent`` is K[-1]: 32 zero octets for a
    chain of its own, or the last Block Key of a shared-scope prefix that this chain continues.
    """

    __slots__ = ("_block_octets", "_keys", "_last", "_pending", "_template")

    def __init__(
        self,
        scope_key: bytes,
        compat_id: CompatId,
        block_tokens: int,
        parent: BlockKey = ROOT_PARENT,
    ) -> None:
        key = _check_scope_key(scope_key)
        if len(compat_id) != 32:
            raise KeyMaterialError("compat id must be 32 octets")
        if len(parent) != 32:
            raise KeyMaterialError("parent block key must be 32 octets")
        if not isinstance(block_tokens, int) or block_tokens < 1:
            raise KeyMaterialError("block_tokens must be a positive integer")
        self._template = HmacTemplate(key, BLOCK_DOMAIN + bytes(compat_id))
        self._block_octets = 4 * block_tokens
        self._last: bytes = bytes(parent)
        self._pending = b""
        self._keys: list[BlockKey] = []

    @property
    def keys(self) -> list[BlockKey]:
        """Every key completed so far, in block order (a copy)."""
        return list(self._keys)

    @property
    def pending_tokens(self) -> int:
        """Tokens received after the last complete block."""
        return len(self._pending) // 4

    def extend(self, tokens: Tokens) -> list[BlockKey]:
        """Append tokens; return the keys of the blocks they complete."""
        octets = token_octets(tokens)
        if self._pending:
            octets = memoryview(self._pending + octets)
        step = self._block_octets
        count = len(octets) // step
        self._pending = octets[count * step :].tobytes()
        if count == 0:
            return []
        # HmacTemplate.digest inlined: this loop is the hot path of every lookup.
        inner_copy = self._template.inner.copy
        outer_copy = self._template.outer.copy
        prev = self._last
        out: list[BlockKey] = []
        append = out.append
        for chunk in _split(octets, step, count):
            inner = inner_copy()
            inner.update(prev)
            inner.update(chunk)
            outer = outer_copy()
            outer.update(inner.digest())
            prev = outer.digest()
            append(prev)  # type: ignore[arg-type]
        self._last = prev
        self._keys.extend(out)
        return out


def block_keys(
    scope_key: bytes,
    compat_id: CompatId,
    tokens: Tokens,
    block_tokens: int,
    parent: BlockKey = ROOT_PARENT,
) -> list[BlockKey]:
    """Block Keys of the complete blocks of ``tokens``; a partial trailing block has none."""
    return BlockKeyChain(scope_key, compat_id, block_tokens, parent).extend(tokens)
