"""Pools for instance tests: the holder store with a G1 page tier in front of G2, over the
small blocks of ``tests.holder.factories`` (4 layers of 128 octets)."""

from __future__ import annotations

from kvsp.core.clock import ManualClock
from kvsp.core.registries import Tier
from kvsp.holder.blocks import BlockId
from kvsp.holder.leases import LeaseLimits, LeaseTable
from kvsp.holder.store import BlockStore, LeaseView, Protected, TierData, TierSpec
from kvsp.holder.tiers import MemoryTier
from kvsp.instance.kvpool import BlockRefs, KvPages
from tests.holder.factories import block_id, stored

HOLDER = "http://127.0.0.1:9201/kvsp/"
LAYERS = 4
PAGE = 128  # one layer of a factory block: K 64 + V 64 octets
BLOCK = LAYERS * PAGE


def pool(
    g1_blocks: int,
    g2_blocks: int,
    g1_layers: int = LAYERS,
    clock: ManualClock | None = None,
    *more: LeaseView,
) -> tuple[BlockStore, KvPages, BlockRefs, LeaseTable]:
    clock = clock or ManualClock()
    pages = KvPages(g1_blocks, g1_layers, PAGE)
    refs = BlockRefs()
    leases = LeaseTable(clock, LeaseLimits(quota_octets=1 << 20, max_ttl_ms=10_000))
    data: dict[Tier, TierData] = {"device": pages, "host": MemoryTier()}
    tiers = [TierSpec("device", pages.capacity), TierSpec("host", g2_blocks * BLOCK, 96_000)]
    store = BlockStore(tiers, data, Protected(leases, refs, *more), clock, HOLDER, 10_000)
    return store, pages, refs, leases


def split(g1_layers: int) -> list[tuple[Tier, tuple[int, int]]]:
    return [("device", (0, g1_layers - 1)), ("host", (g1_layers, LAYERS - 1))]


def put(store: BlockStore, n: int, placement: list[tuple[Tier, tuple[int, int]]] | None = None
        ) -> BlockId:  # fmt: skip
    meta, data, _ = stored(n)
    store.put(block_id(n), meta, data, placement)
    return block_id(n)


def read(store: BlockStore, block: BlockId) -> bytes:
    found = store.get(block)
    return b"".join(bytes(p) for p in found.parts)
