"""Which KVSP blocks vLLM's own paged cache (G1) holds, from vLLM's KV events (pure).

vLLM names a cached page by its page hash and reports, each engine step, the pages it cached
(``BlockStored``), evicted (``BlockRemoved``) and all of them dropped (``AllBlocksCleared``).
kvsp names blocks by Block Key. The connector knows both for every full page of a request it
serves (``record``: the page's hash and the KVSP blocks in it); the events then say which of
those blocks sit in vLLM's pages. A page stored before it was recorded (the event and the
connector's step are not ordered) is remembered by hash until it is.

Changes go to the watcher as (block, now in G1) pairs, once per change, in order. Both tables
are bounded (the oldest entries go first); a hash forgotten early costs only an unreported page.
The connector records on vLLM's scheduler thread and the events arrive on a subscriber's thread,
so every change is made under one lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvsp.holder.blocks import BlockId

__all__ = ["G1Change", "G1Pages", "PageHash"]

#: vLLM's page hash as its events carry it (an int by default, bytes otherwise)
PageHash = int | bytes
#: a block that entered (True) or left (False) vLLM's pages
G1Change = tuple[BlockId, bool]


class G1Pages:
    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._watcher: Callable[[list[G1Change]], None] | None = None
        #: page hash -> the KVSP blocks in that page, for pages the connector keyed
        self._blocks: OrderedDict[PageHash, tuple[BlockId, ...]] = OrderedDict()
        #: pages vLLM holds (stored and not removed since), known or not yet keyed
        self._held: OrderedDict[PageHash, None] = OrderedDict()
        #: blocks in G1, with how many held pages carry them (two requests' pages may)
        self._count: dict[BlockId, int] = {}

    def __len__(self) -> int:
        return len(self._count)

    def holds(self, block: BlockId) -> bool:
        return block in self._count

    def watch(self, watcher: Callable[[list[G1Change]], None]) -> None:
        """Send every change from now on to ``watcher``, starting with the blocks held now."""
        with self._lock:
            self._watcher = watcher
            self._report([(block, True) for block in self._count])

    def record(self, page: PageHash, blocks: Sequence[BlockId]) -> None:
        """The connector keyed a full page: these KVSP blocks, in order, fill it."""
        with self._lock:
            if page not in self._blocks and blocks:
                self._record(page, blocks)

    def _record(self, page: PageHash, blocks: Sequence[BlockId]) -> None:
        self._blocks[page] = tuple(blocks)
        changes: list[G1Change] = []
        if len(self._blocks) > self._capacity:  # forgotten: no longer reported as held
            old, old_blocks = self._blocks.popitem(last=False)
            if old in self._held:
                changes += self._remove(old_blocks)
        if page in self._held:
            changes += self._add(self._blocks[page])
        self._report(changes)

    def stored(self, pages: Iterable[PageHash]) -> None:
        with self._lock:
            self._stored(pages)

    def _stored(self, pages: Iterable[PageHash]) -> None:
        changes: list[G1Change] = []
        for page in pages:
            if page in self._held:
                continue
            self._held[page] = None
            if len(self._held) > self._capacity:
                old, _ = self._held.popitem(last=False)
                changes += self._remove(self._blocks.get(old, ()))
            changes += self._add(self._blocks.get(page, ()))
        self._report(changes)

    def removed(self, pages: Iterable[PageHash]) -> None:
        with self._lock:
            self._release([p for p in pages if p in self._held])

    def cleared(self) -> None:
        with self._lock:
            self._release(list(self._held))

    def _release(self, pages: Sequence[PageHash]) -> None:
        changes: list[G1Change] = []
        for page in pages:
            del self._held[page]
            changes += self._remove(self._blocks.get(page, ()))
        self._report(changes)

    def _add(self, blocks: Iterable[BlockId]) -> list[G1Change]:
        changes = []
        for block in blocks:
            n = self._count.get(block, 0)
            self._count[block] = n + 1
            if not n:
                changes.append((block, True))
        return changes

    def _remove(self, blocks: Iterable[BlockId]) -> list[G1Change]:
        changes = []
        for block in blocks:
            n = self._count[block] - 1
            if n:
                self._count[block] = n
            else:
                del self._count[block]
                changes.append((block, False))
        return changes

    def _report(self, changes: list[G1Change]) -> None:
        if changes and self._watcher is not None:
            self._watcher(changes)
