"""The instance's paged KV pool, pure: G1 pages and the reference counts of blocks in use.

An instance keeps blocks in the same tiered ``BlockStore`` as a standalone holder, with one more
tier in front: ``device`` (G1, the engine's KV pages) before ``host`` (G2). The store decides
what lives where (LRU with retention priorities, G1 victims demoted to G2 before anything is
dropped, every drop withdrawn first, per-layer residency in the Replica Record); this module
supplies the two parts that are the pool's own:

- ``KvPages``, the G1 tier's octets: one preallocated array of fixed pages, one page per layer of
  a block of ``block_tokens`` tokens (kvsp-layout-1: K then V, ``[tokens, kv_heads, head_dim]``).
  The capacity is counted in blocks (``blocks x layers`` pages); a block may keep only its first
  layers here and the rest in G2, using only as many pages. Free pages are a stack, so taking and
  returning a page is O(1) and memory never grows after start.
- ``BlockRefs``, reference counts of blocks that running requests use (their reused prefix and
  the blocks they complete): like a lease, a block in use is never demoted or dropped by
  pressure, so a request's blocks stay where its session will look for them. The holder joins
  these with its leases into the one view the store consults.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

import numpy as np

from kvsp.core.problems import CapacityExhausted, ConfigurationError
from kvsp.holder.blocks import BlockId, BlockMeta
from kvsp.holder.store import Span

__all__ = ["BlockRefs", "KvPages"]


class KvPages:
    """G1 octets in fixed pages (a ``TierData`` for the store's ``device`` tier)."""

    def __init__(self, blocks: int, layers: int, page_octets: int) -> None:
        if blocks < 1 or layers < 1 or page_octets < 1:
            raise ConfigurationError("G1 needs at least one block of at least one layer")
        self.page_octets = page_octets
        self.capacity = blocks * layers * page_octets
        # untouched pages cost no memory until first written
        self._pages = np.empty((blocks * layers, page_octets), dtype=np.uint8)
        self._free = list(range(blocks * layers - 1, -1, -1))  # lowest page taken first
        self._held: dict[BlockId, list[int]] = {}

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def accepts(self, meta: BlockMeta, span: Span) -> bool:
        """Only layers that fill a page exactly (a whole block of this engine's geometry)."""
        return all(sum(meta.lengths[i]) == self.page_octets for i in range(span[0], span[1] + 1))

    def write(
        self, block: BlockId, meta: BlockMeta, span: Span, data: Sequence[memoryview]
    ) -> None:
        if not self.accepts(meta, span):
            raise ValueError("G1 pages hold layers of exactly one page each")
        self.delete(block)
        count = span[1] - span[0] + 1
        if count > len(self._free):
            raise CapacityExhausted(f"G1 has {len(self._free)} free pages, {count} needed")
        pages = [self._free.pop() for _ in range(count)]
        flat = data[0] if len(data) == 1 else memoryview(b"".join(data))
        self._pages[pages] = np.frombuffer(flat, dtype=np.uint8).reshape(count, -1)
        self._held[block] = pages

    def read(self, block: BlockId, meta: BlockMeta, stored: Span, span: Span) -> memoryview:
        """A copy of the layers' pages: a page may hold another block once this one goes."""
        pages = self._held[block][span[0] - stored[0] : span[1] - stored[0] + 1]
        return self._pages[pages].reshape(-1).data

    def delete(self, block: BlockId) -> None:
        self._free.extend(reversed(self._held.pop(block, ())))


class BlockRefs:
    """How many running requests use each block (a ``LeaseView``)."""

    def __init__(self) -> None:
        self._refs: Counter[BlockId] = Counter()
        self._ended = 0

    def acquire(self, blocks: Iterable[BlockId]) -> None:
        self._refs.update(blocks)

    def release(self, blocks: Iterable[BlockId]) -> None:
        for block in blocks:
            count = self._refs[block]
            if count <= 0:
                raise ValueError("a block released more often than acquired")
            if count == 1:
                del self._refs[block]
                self._ended += 1
            else:
                self._refs[block] = count - 1

    def count(self, block: BlockId) -> int:
        return self._refs[block]

    def leased(self, block: BlockId) -> bool:
        return block in self._refs

    def leased_blocks(self) -> Iterable[BlockId]:
        return self._refs.keys()

    def leased_count(self) -> int:
        return len(self._refs)

    def ended(self) -> int:
        return self._ended
