"""Scope IDs and the keyed Block Key chain (KVSP 4.2).

A Block Key names a block together with its whole prefix, and only holders of the scope key can
compute it. The chain is the hot path of every lookup, so it runs on a keyed HMAC template that
is copied per block (the key schedule is paid once per chain) and on token octets converted in
one vectorised step; the per-block Python work is a copy, two updates and a digest.
"""

from __future__ import annotations

import array
import hashlib
import hmac
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
    "Tokens",
    "block_keys",
    "hmac_template",
    "scope_id",
    "tokens_to_octets",
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


def hmac_template(key: bytes, prefix: bytes = b"") -> hmac.HMAC:
    """A keyed HMAC-SHA-256 state that has absorbed ``prefix``; ``.copy()`` it per message.

    Copying the template skips the key schedule (two compression calls) for every block.
    """
    return hmac.new(key, prefix, hashlib.sha256)


def scope_id(scope_key: bytes) -> ScopeId:
    """First 16 octets of SHA-256("KVSP-SCOPE-1" || 0x00 || scope_key)."""
    key = _check_scope_key(scope_key)
    return ScopeId(hashlib.sha256(SCOPE_DOMAIN + key).digest()[:16])


def tokens_to_octets(tokens: Tokens) -> bytes:
    """Tokens as uint32 in network byte order; ids outside 0..2^32-1 are an error."""
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise KeyMaterialError("tokens must be a one-dimensional integer array")
        if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > 0xFFFFFFFF):
            raise KeyMaterialError("token ids must be in 0..2^32-1")
        return tokens.astype(">u4", copy=False).tobytes()
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
    return packed.tobytes()


def _split(octets: bytes, step: int, count: int) -> list[bytes] | list[memoryview]:
    if step <= _VIEW_SPLIT_MAX_OCTETS:
        chunks: list[bytes] = np.frombuffer(octets, dtype=f"V{step}", count=count).tolist()
        return chunks
    view = memoryview(octets)
    return [view[o : o + step] for o in range(0, count * step, step)]


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
        self._template = hmac_template(key, BLOCK_DOMAIN + bytes(compat_id))
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
        octets = self._pending + tokens_to_octets(tokens)
        step = self._block_octets
        count = len(octets) // step
        self._pending = octets[count * step :]
        if count == 0:
            return []
        copy = self._template.copy
        prev = self._last
        out: list[BlockKey] = []
        append = out.append
        for chunk in _split(octets, step, count):
            h = copy()
            h.update(prev)
            h.update(chunk)
            prev = h.digest()
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
