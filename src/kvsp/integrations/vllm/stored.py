"""Which of vLLM's pages the connector has stored at the kvsp holder, as vLLM KV events (pure).

Under a stock ``vllm serve`` with KV events on, vLLM's own publisher carries its G1 events and
whatever the connector's ``take_events`` yields. The connector reports what it put beyond G1:
a page is announced once every KVSP block in it is stored at the holder, under vLLM's page hash
with vLLM's parent hash and the page's tokens, so consumers join it to the pages they know.
The medium is ``CPU`` (a holder's memory tier) with locality ``REMOTE`` and ownership
``kvsp``: not this engine's memory, but loadable by it. The worker tells which blocks its PUTs
stored (by the low 64 bits of their Block Keys); the scheduler keyed the pages. Both tables are
bounded, oldest first: a page forgotten early is only not announced. The holder's evictions are
not seen here; a consumer learns of them as blocks stop loading.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvsp.integrations.vllm.g1 import PageHash

__all__ = ["HolderPages", "StoredPage"]


@dataclass(frozen=True, slots=True)
class StoredPage:
    page: PageHash
    parent: PageHash | None
    tokens: tuple[int, ...]


@dataclass(slots=True)
class _Page:
    parent: PageHash | None
    tokens: tuple[int, ...]
    #: the low 64 bits of the Block Keys of its KVSP blocks not stored yet
    missing: set[int]


class HolderPages:
    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._pages: OrderedDict[PageHash, _Page] = OrderedDict()
        #: block hash -> the pages waiting for it
        self._waiting: dict[int, list[PageHash]] = {}
        #: blocks stored before their page was keyed (the two come from different threads)
        self._early: OrderedDict[int, None] = OrderedDict()
        self._announced: OrderedDict[PageHash, None] = OrderedDict()
        self._ready: list[StoredPage] = []

    def record(
        self,
        page: PageHash,
        parent: PageHash | None,
        tokens: Sequence[int],
        blocks: Iterable[int],
    ) -> None:
        """A full page the connector keyed: its parent, its tokens, its blocks' hashes."""
        if page in self._pages or page in self._announced:
            return
        missing = {b for b in blocks if b not in self._early}
        entry = _Page(parent, tuple(tokens), missing)
        self._pages[page] = entry
        for block in missing:
            self._waiting.setdefault(block, []).append(page)
        self._check(page, entry)
        while len(self._pages) > self._capacity:
            old, gone = self._pages.popitem(last=False)
            for block in gone.missing:
                self._unwait(block, old)

    def stored(self, blocks: Iterable[int]) -> None:
        """The worker stored these blocks at the holder."""
        for block in blocks:
            pages = self._waiting.pop(block, None)
            if pages is None:
                self._early[block] = None
                while len(self._early) > self._capacity:
                    self._early.popitem(last=False)
                continue
            for page in pages:
                entry = self._pages.get(page)
                if entry is not None:
                    entry.missing.discard(block)
                    self._check(page, entry)

    def _check(self, page: PageHash, entry: _Page) -> None:
        if entry.missing:
            return
        del self._pages[page]
        self._ready.append(StoredPage(page, entry.parent, entry.tokens))
        self._announced[page] = None
        while len(self._announced) > self._capacity:
            self._announced.popitem(last=False)

    def _unwait(self, block: int, page: PageHash) -> None:
        pages = self._waiting.get(block)
        if pages is not None and page in pages:
            pages.remove(page)
            if not pages:
                del self._waiting[block]

    def take(self) -> list[StoredPage]:
        """The pages wholly stored since the last call, in the order they became so."""
        out, self._ready = self._ready, []
        return out
