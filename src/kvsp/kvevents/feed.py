"""What an instance publishes as vLLM KV events, pure: its blocks' media turned into
``BlockStored`` / ``BlockRemoved``, each block once per medium.

vLLM's consumers index blocks by their token ids and chain them by parent hash, so a block is
published at a medium only once the instance knows its tokens and its parent (``learn``: a
request's prompt, the blocks it completes) and holds it there (``resident``: the pool's tiers,
the engine's pages). A block whose tokens the instance never saw (a Prefetch directive's, a
Share's PUT) stays unpublished until a request that uses it tells them. Tokens of blocks not
held are kept for at most ``max_learned`` blocks, oldest forgotten first; those of held blocks
stay while they are held (the pool bounds them).

``snapshot`` restates everything published, after ``AllBlocksCleared``: what a publisher sends
when it starts, and after it had to drop batches (a subscriber can then never be left with a
silent gap).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvsp.kvevents.wire import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent, external_hash

__all__ = ["BlockId", "KvEventFeed"]

#: (compat_id, scope_id, block_key), hex, as the holder names blocks
BlockId = tuple[str, str, str]


@dataclass(frozen=True, slots=True)
class _Tokens:
    hash: int
    parent: int | None
    tokens: tuple[int, ...]
    scope: str
    session: str | None


def _hash_of(block: BlockId) -> int:
    return external_hash(bytes.fromhex(block[2]))


class KvEventFeed:
    def __init__(self, block_tokens: int, max_learned: int = 65_536) -> None:
        self.block_tokens = block_tokens
        self.max_learned = max_learned
        #: tokens of blocks not held here, newest last
        self._learned: OrderedDict[BlockId, _Tokens] = OrderedDict()
        #: held blocks: their tokens (None: not known yet) and the media they are held in
        self._tokens: dict[BlockId, _Tokens | None] = {}
        self._held: dict[BlockId, frozenset[str]] = {}
        #: media each block was published at (a subset of what it is held in)
        self._published: dict[BlockId, frozenset[str]] = {}
        self._out: list[KvEvent] = []

    def __len__(self) -> int:
        """Blocks published at one medium at least."""
        return len(self._published)

    def learn(
        self,
        block: BlockId,
        parent: BlockId | None,
        tokens: Sequence[int],
        session: str | None = None,
    ) -> None:
        """``block`` (after ``parent``, None for the first of its chain) holds ``tokens``."""
        if len(tokens) != self.block_tokens:
            raise ValueError(f"a block holds {self.block_tokens} tokens, not {len(tokens)}")
        known = _Tokens(
            _hash_of(block), None if parent is None else _hash_of(parent),
            tuple(tokens), block[1], session,
        )  # fmt: skip
        if block in self._held:
            if self._tokens[block] is None:
                self._tokens[block] = known
                self._publish(block, self._held[block])
            return
        self._learned[block] = known
        self._learned.move_to_end(block)
        while len(self._learned) > self.max_learned:
            self._learned.popitem(last=False)

    def resident(self, block: BlockId, media: frozenset[str]) -> None:
        """``block`` is now held in ``media`` here (empty: nowhere)."""
        published = self._published.get(block, frozenset())
        gone = published - media
        if gone:
            hashes: list[int | bytes] = [_hash_of(block)]
            self._out.extend(BlockRemoved(hashes, medium) for medium in sorted(gone))
        if not media:
            self._held.pop(block, None)
            self._tokens.pop(block, None)
            self._published.pop(block, None)
            return
        if block not in self._held:
            self._tokens[block] = self._learned.pop(block, None)
        self._held[block] = media
        if gone:
            if published - gone:
                self._published[block] = published - gone
            else:
                del self._published[block]
        self._publish(block, media)

    def _publish(self, block: BlockId, media: frozenset[str]) -> None:
        known = self._tokens[block]
        if known is None:
            return
        published = self._published.get(block, frozenset())
        for medium in sorted(media - published):
            self._out.append(self._stored(known, medium))
        self._published[block] = published | media

    def _stored(self, known: _Tokens, medium: str) -> BlockStored:
        # the scope salts a chain's first block, as vLLM's cache_salt does: consumers that
        # hash extra keys keep tenants apart
        salt: list[tuple[Any, ...] | None] | None = (
            [(known.scope,)] if known.parent is None else None
        )
        return BlockStored(
            [known.hash], known.parent, list(known.tokens), self.block_tokens,
            None, medium, None, extra_keys=salt, session_id=known.session,
        )  # fmt: skip

    def take(self) -> list[KvEvent]:
        """The events since the last call, consecutive stores of one chain and medium joined
        into one ``BlockStored`` (as vLLM sends a request's blocks)."""
        out, self._out = self._out, []
        joined: list[KvEvent] = []
        for event in out:
            last = joined[-1] if joined else None
            if (
                isinstance(event, BlockStored)
                and isinstance(last, BlockStored)
                and event.extra_keys is None
                and event.parent_block_hash == last.block_hashes[-1]
                and event.medium == last.medium
                and event.session_id == last.session_id
            ):
                last.block_hashes.append(event.block_hashes[0])
                last.token_ids.extend(event.token_ids)
                if last.extra_keys is not None:
                    last.extra_keys.append(None)
                continue
            joined.append(event)
        return joined

    def snapshot(self) -> list[KvEvent]:
        """``AllBlocksCleared``, then a store of every block at every medium it was published
        at (parents before children, as they were first published); pending events dropped."""
        self._out = []
        for block, media in self._published.items():
            known = self._tokens[block]
            assert known is not None  # published blocks have their tokens
            self._out.extend(self._stored(known, medium) for medium in sorted(media))
        return [AllBlocksCleared(), *self.take()]
