"""Public prefixes shared across tenants (KVSP 4.2, docs/decisions/0015-shared-prefixes.md).

A deployment declares a shared scope for a public prefix (a common system prompt): its own
scope key, the tenants allowed to use it, and the prefix's tokens. A tenant's prompt that begins
with the prefix keys those whole blocks with the shared scope's key (a chain of its own, from
K[-1] = 32 zero octets), exactly as every allowed tenant keys them, and continues the chain with
its own key from the last shared Block Key as parent. So the shared blocks are one set of
blocks in one scope; everything after them is the tenant's alone (its keys cover the shared
prefix through the parent, and only the tenant's key can compute them).

A block is shared while every block before it was and its tokens are the prefix's block at the
same place; the first block that differs (or passes the prefix's whole blocks) and every later
one are the tenant's. Sans-IO, pure.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kvsp.core.ids import BlockKey, CompatId
from kvsp.core.keys import ROOT_PARENT, BlockKeyChain, Tokens, block_keys

__all__ = ["ScopedChain", "SharedScope", "scope_runs", "shared_blocks"]

T = TypeVar("T")


@dataclass(frozen=True)
class SharedScope:
    """A shared scope: its key (a secret of the deployment), its Scope ID, and its prefix."""

    name: str
    scope_key: bytes = field(repr=False)
    scope_id: str
    tokens: tuple[int, ...]

    def blocks(self, block_tokens: int) -> int:
        """Whole blocks of the prefix: only they can be shared."""
        return len(self.tokens) // block_tokens

    def keys(self, compat_id: CompatId, block_tokens: int) -> list[str]:
        """The Block Keys of the prefix's whole blocks, in the shared scope."""
        return [k.hex() for k in block_keys(self.scope_key, compat_id, self.tokens, block_tokens)]


def shared_blocks(
    candidates: Sequence[SharedScope], keys: Sequence[str], compat_id: CompatId, block_tokens: int
) -> tuple[SharedScope | None, int]:
    """Which shared scope the first blocks of ``keys`` (a checkpoint's, say) belong to, and how
    many of them: a shared block is known by its key alone."""
    for shared in candidates:
        theirs = shared.keys(compat_id, block_tokens)
        count = 0
        for mine, key in zip(keys, theirs, strict=False):
            if mine != key:
                break
            count += 1
        if count:
            return shared, count
    return None, 0


def scope_runs(
    items: Sequence[T], scope_of: Callable[[int], str], first: int = 0
) -> list[tuple[str, list[T]]]:
    """``items`` (blocks ``first``, ``first + 1``, ... of a sequence) cut into runs of one scope,
    in order: what one lookup can ask for (a lookup names one scope)."""
    scoped = zip(map(scope_of, itertools.count(first)), items, strict=False)
    return [
        (scope, [item for _, item in run])
        for scope, run in itertools.groupby(scoped, lambda p: p[0])
    ]


class ScopedChain:
    """The Block Keys of a token sequence whose first blocks may be a shared prefix's.

    ``blocks`` blocks came before this chain (their last key is ``parent``), the first
    ``shared_count`` of them in the scope ``shared``; when all of them were, the chain goes on
    sharing while the tokens follow that prefix. With no blocks before, the first block chooses
    among ``candidates``. ``scope_of(i)`` says each block's scope, counted from the sequence's
    start.
    """

    def __init__(
        self,
        scope_key: bytes,
        scope_id: str,
        compat_id: CompatId,
        block_tokens: int,
        candidates: Sequence[SharedScope] = (),
        *,
        parent: BlockKey = ROOT_PARENT,
        blocks: int = 0,
        shared: SharedScope | None = None,
        shared_count: int = 0,
    ) -> None:
        self._scope_key = scope_key
        self.scope_id = scope_id
        self._compat = compat_id
        self._b = block_tokens
        self._index = blocks
        self._parent = parent
        self._pending: list[int] = []
        self._keys: list[BlockKey] = []
        #: the shared scope of the first blocks, and how many blocks from the start are in it
        self.shared = shared if shared_count else None
        self.shared_count = shared_count if shared is not None else 0
        self._candidates = tuple(candidates) if blocks == 0 else ()
        sharing = self.shared is not None and self.shared_count == blocks
        self._tenant: BlockKeyChain | None = (
            None
            if sharing or self._candidates
            else BlockKeyChain(scope_key, compat_id, block_tokens, parent)
        )

    @property
    def keys(self) -> list[BlockKey]:
        """Every key this chain completed, in block order (a copy)."""
        return list(self._keys) if self._tenant is None else self._keys + self._tenant.keys

    @property
    def pending_tokens(self) -> int:
        if self._tenant is not None:
            return self._tenant.pending_tokens
        return len(self._pending)

    def scope_of(self, index: int) -> str:
        """The scope of block ``index`` of the whole sequence."""
        if self.shared is not None and index < self.shared_count:
            return self.shared.scope_id
        return self.scope_id

    def extend(self, tokens: Tokens) -> list[BlockKey]:
        """Append tokens; the keys of the blocks they complete."""
        if self._tenant is not None:
            return self._tenant.extend(tokens)
        self._pending.extend(int(t) for t in tokens)
        out: list[BlockKey] = []
        b = self._b
        while len(self._pending) >= b:
            block, self._pending = self._pending[:b], self._pending[b:]
            shared = self._sharing(block)
            if shared is None:  # from here on the tenant's: one chain takes all the rest
                self._tenant = BlockKeyChain(self._scope_key, self._compat, b, self._parent)
                rest, self._pending = block + self._pending, []
                return out + self._tenant.extend(rest)
            (key,) = block_keys(shared.scope_key, self._compat, block, b, self._parent)
            self.shared, self._candidates = shared, ()
            self.shared_count = self._index = self._index + 1
            self._parent = key
            self._keys.append(key)
            out.append(key)
        return out

    def _sharing(self, block: list[int]) -> SharedScope | None:
        """The shared scope block ``self._index`` belongs to, or None: the tenant's."""
        i, b = self._index, self._b
        options = self._candidates if self.shared is None else (self.shared,)
        for shared in options:
            if i < shared.blocks(b) and list(shared.tokens[i * b : (i + 1) * b]) == block:
                return shared
        return None
