"""The connector's KV events in vLLM's classes: what a worker stored at the holder, carried to
the scheduler in ``KVConnectorOutput.kv_cache_events``, and the pages announced from
``take_events`` (``stored.py`` decides which)."""

from __future__ import annotations

from collections.abc import Sequence

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    BlockStored,
    KVCacheEvent,
    KVConnectorKVEvents,
    KVEventAggregator,
)

from kvsp.integrations.vllm.stored import StoredPage

__all__ = ["HolderStores", "stored_events"]

#: the stores are at a kvsp holder: not this engine's memory, but loadable by it
LOCALITY = "REMOTE"
OWNERSHIP = "kvsp"


class HolderStores(KVConnectorKVEvents):
    """A worker's report of the KVSP blocks it stored at the holder since its last one: one
    ``BlockStored`` naming their hashes (no tokens: the scheduler knows the pages). Across
    workers only what every worker reports counts, as vLLM aggregates connector events."""

    def __init__(self, blocks: Sequence[int], block_tokens: int) -> None:
        self._aggregator = KVEventAggregator(1)
        if blocks:
            report = BlockStored(
                block_hashes=list(blocks), parent_block_hash=None, token_ids=[],
                block_size=block_tokens, lora_id=None, medium=MEDIUM_CPU, lora_name=None,
                ownership=OWNERSHIP,
            )  # fmt: skip
            self._aggregator.add_events([report])

    def add_events(self, events: list[KVCacheEvent]) -> None:
        self._aggregator.add_events(events)

    def aggregate(self) -> HolderStores:
        common = self._aggregator.get_common_events()
        self._aggregator.clear_events()
        self._aggregator.add_events(common)
        self._aggregator.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._aggregator.increment_workers(count)

    def get_all_events(self) -> list[KVCacheEvent]:
        return self._aggregator.get_all_events()

    def get_number_of_workers(self) -> int:
        return self._aggregator.get_number_of_workers()

    def clear_events(self) -> None:
        self._aggregator.clear_events()
        self._aggregator.reset_workers()

    def blocks(self) -> list[int]:
        """The hashes of the blocks stored (after ``aggregate``)."""
        out: list[int] = []
        for event in self.get_all_events():
            if isinstance(event, BlockStored):
                out.extend(h for h in event.block_hashes if isinstance(h, int))
        return out


def stored_events(pages: Sequence[StoredPage], page_tokens: int) -> list[BlockStored]:
    """vLLM's events for pages now wholly at the holder."""

    def event(p: StoredPage) -> BlockStored:
        return BlockStored(
            block_hashes=[p.page], parent_block_hash=p.parent, token_ids=list(p.tokens),
            block_size=page_tokens, lora_id=None, medium=MEDIUM_CPU, lora_name=None,
            locality=LOCALITY, ownership=OWNERSHIP,
        )  # fmt: skip

    return [event(p) for p in pages]
