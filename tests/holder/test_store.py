"""The tiered store: placement, exact eviction order, demotion, leases, effects, records."""

from __future__ import annotations

import contextlib
import heapq

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp.core.clock import ManualClock
from kvsp.core.problems import (
    AlreadyStored,
    CapacityExhausted,
    ConfigurationError,
    DigestError,
    LayersUnavailable,
    LeaseQuotaExceeded,
    NotFound,
)
from kvsp.core.registries import Tier
from kvsp.holder.blocks import BlockId, BlockMeta
from kvsp.holder.leases import LeaseLimits, LeaseTable
from kvsp.holder.store import BlockStore, Publish, TierSpec, Withdraw
from kvsp.holder.tiers import MemoryTier
from tests.holder.factories import block_id, container, stored

HOLDER = "http://127.0.0.1:9101/kvsp/"
#: 4 layers x (64 + 64) octets of data per block
BLOCK = 4 * 128


class CorruptingTier(MemoryTier):
    """A memory tier that reports a digest failure for chosen blocks (a disk gone bad)."""

    def __init__(self) -> None:
        super().__init__()
        self.bad: set[BlockId] = set()

    def read(self, block, meta, stored, span):  # type: ignore[no-untyped-def]
        if block in self.bad:
            raise DigestError("flipped")
        return super().read(block, meta, stored, span)


def make(
    host_blocks: int = 2,
    disk_blocks: int = 2,
    clock: ManualClock | None = None,
    overhead: int = 0,
) -> tuple[BlockStore, LeaseTable, ManualClock]:
    clock = clock or ManualClock()
    leases = LeaseTable(clock, LeaseLimits(quota_octets=1 << 20, max_ttl_ms=10_000))
    tiers = [TierSpec("host", host_blocks * (BLOCK + overhead))]
    data: dict[Tier, MemoryTier] = {"host": MemoryTier()}
    if disk_blocks:
        tiers.append(TierSpec("disk", disk_blocks * (BLOCK + overhead), 16_000))
        data["disk"] = CorruptingTier()
    store = BlockStore(
        tiers,
        data,  # type: ignore[arg-type]
        leases,
        clock,
        HOLDER,
        record_ttl_ms=10_000,
        block_overhead=overhead,
    )
    return store, leases, clock


def put(store: BlockStore, n: int) -> BlockId:
    meta, data, _ = stored(n)
    store.put(block_id(n), meta, data)
    return block_id(n)


def where(store: BlockStore, *ns: int) -> list[str | None]:
    out = []
    for n in ns:
        b = block_id(n)
        out.append(None if b not in store else ",".join(store.spans(b)))
    return out


def test_put_get_roundtrip_and_record() -> None:
    store, _, _ = make()
    meta, data, octets = stored(1)
    record = store.put(block_id(1), meta, data)
    assert record.holder == HOLDER
    assert record.size == len(octets) == meta.size
    assert record.residency[0].tier == "host"
    assert record.residency[0].layers == (0, 3)
    assert record.digest == "sha-256:" + container(1).digest().hex()
    read = store.get(block_id(1))
    assert read.header.encode() + b"".join(read.parts) == octets
    part = store.get(block_id(1), 1, 2)
    assert part.header.encode() + b"".join(part.parts) == container(1).slice(1, 2).tobytes()
    assert [type(e) for e in store.take_effects()] == [Publish]
    assert store.stats.hits == 2


def test_second_put_is_412_and_keeps_the_first() -> None:
    store, _, _ = make()
    put(store, 1)
    store.take_effects()
    meta, data, _ = stored(2)  # other octets under the same key
    with pytest.raises(AlreadyStored):
        store.put(block_id(1), meta, data)
    assert store.meta(block_id(1)) == stored(1)[0]
    assert store.take_effects() == []


def test_missing_blocks_and_layers() -> None:
    store, _, _ = make()
    put(store, 1)
    with pytest.raises(NotFound):
        store.get(block_id(9))
    with pytest.raises(LayersUnavailable):
        store.get(block_id(1), 2, 4)
    assert store.stats.misses == 2


def test_exact_eviction_order_lru_with_demotion_then_drop() -> None:
    store, _, _ = make(host_blocks=2, disk_blocks=2)
    put(store, 1)
    put(store, 2)
    store.get(block_id(1))  # 2 is now least recently used
    store.take_effects()
    put(store, 3)  # host full: 2 moves to disk
    assert where(store, 1, 2, 3) == ["host", "disk", "host"]
    effects = store.take_effects()
    assert [type(e) for e in effects] == [Publish, Publish]
    assert effects[0].record.block_key == block_id(2)[2]  # type: ignore[union-attr]
    assert effects[0].record.residency[0].tier == "disk"  # type: ignore[union-attr]
    assert effects[0].record.residency[0].read_mbit_per_s == 16_000  # type: ignore[union-attr]
    put(store, 4)  # 1 is LRU in host: to disk
    put(store, 5)  # 3 to disk; disk full: its LRU (2) is dropped first
    assert where(store, 1, 2, 3, 4, 5) == ["disk", None, "disk", "host", "host"]
    kinds = [
        (type(e).__name__, (e.ref if isinstance(e, Withdraw) else e.record).block_key)
        for e in store.take_effects()
    ]
    assert kinds == [
        ("Publish", block_id(1)[2]),
        ("Publish", block_id(4)[2]),
        ("Withdraw", block_id(2)[2]),
        ("Publish", block_id(3)[2]),
        ("Publish", block_id(5)[2]),
    ]
    assert store.stats.evictions == {"disk": 1}
    assert store.stats.demotions == {"host": 3}


def test_a_used_chain_loses_its_tail_before_its_head() -> None:
    store, _, _ = make(host_blocks=3, disk_blocks=0)
    chain = [put(store, n) for n in (1, 2, 3)]  # stored root first: the root is the oldest
    store.use(chain)  # a request used them: now the tail is the oldest
    put(store, 4)
    assert where(store, 1, 2, 3, 4) == ["host", "host", None, "host"]
    put(store, 5)
    assert where(store, 1, 2, 3) == ["host", None, None]  # the prefix that is left is usable
    store.use([block_id(9), block_id(1)])  # a block no longer held is passed over


def test_retain_priority_orders_eviction_until_it_ends() -> None:
    store, _, clock = make(host_blocks=2, disk_blocks=0)
    put(store, 1)
    put(store, 2)
    store.retain(block_id(1), priority=5, until_ms=1_000)
    put(store, 3)  # 1 is older but retained: 2 goes
    assert where(store, 1, 2, 3) == ["host", None, "host"]
    clock.advance(1_000)  # retention over: plain LRU again, and 1 is oldest
    put(store, 4)
    assert where(store, 1, 3, 4) == [None, "host", "host"]


def test_leased_block_is_never_moved_and_full_tier_refuses() -> None:
    store, leases, clock = make(host_blocks=2, disk_blocks=0)
    put(store, 1)
    put(store, 2)
    leases.grant("c", [(block_id(1), 1), (block_id(2), 1)], 5_000)
    store.take_effects()
    with pytest.raises(CapacityExhausted):
        put(store, 3)
    assert where(store, 1, 2, 3) == ["host", "host", None]
    assert store.take_effects() == []
    clock.advance(5_000)  # lease over
    put(store, 3)
    assert where(store, 1, 2, 3) == [None, "host", "host"]


def test_lease_passes_over_to_next_victim() -> None:
    store, leases, _ = make(host_blocks=2, disk_blocks=0)
    put(store, 1)
    put(store, 2)
    leases.grant("c", [(block_id(1), 1)], 5_000)
    put(store, 3)
    assert where(store, 1, 2, 3) == ["host", None, "host"]


def test_evictions_pop_past_leased_blocks_once_until_a_lease_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """200 leased blocks at the end of the eviction order: 100 evictions pop past them once,
    not once each; when a lease ends its block is the next to go again, in LRU order."""
    store, leases, _ = make(host_blocks=300, disk_blocks=0)
    for n in range(300):
        put(store, n)
    granted = [leases.grant("c", [(block_id(n), 1)], 5_000).lease for n in range(200)]
    pops = 0
    counted = heapq.heappop

    def counting(heap: list[tuple[int, int, BlockId]]) -> tuple[int, int, BlockId]:
        nonlocal pops
        pops += 1
        return counted(heap)

    monkeypatch.setattr("kvsp.holder.store.heapq.heappop", counting)
    for n in range(300, 400):
        put(store, n)
    assert pops < 200 + 3 * 100  # was about 200 for each eviction
    assert where(store, 0, 199, 200, 299, 300, 399) == ["host", "host", None, None, "host", "host"]
    leases.release("c", granted[0])
    put(store, 400)
    assert where(store, 0, 1, 300, 400) == [None, "host", "host", "host"]


class LaggingView:
    """Holds a set of blocks, and never says that any stopped being held."""

    def __init__(self) -> None:
        self.held: set[BlockId] = set()

    def leased(self, block: BlockId) -> bool:
        return block in self.held

    def leased_blocks(self) -> set[BlockId]:
        return set(self.held)

    def leased_count(self) -> int:
        return len(self.held)

    def ended(self) -> int:
        return 0


def test_a_block_set_aside_is_still_found_when_a_view_lags() -> None:
    """A view whose count of ends lags must not make a full tier refuse what it can take."""
    view = LaggingView()
    store = BlockStore(
        [TierSpec("host", 2 * BLOCK)], {"host": MemoryTier()}, view, ManualClock(), HOLDER
    )
    put(store, 1)
    put(store, 2)
    view.held = {block_id(1), block_id(2)}
    with pytest.raises(CapacityExhausted):
        put(store, 3)  # both set aside
    view.held = {block_id(2)}
    put(store, 3)
    assert where(store, 1, 2, 3) == [None, "host", "host"]


def test_block_larger_than_host_goes_to_disk_and_too_large_is_refused() -> None:
    store, _, _ = make(host_blocks=1, disk_blocks=3)
    meta, data, _ = stored(7, layers=8)  # two blocks' worth
    store.put(block_id(7), meta, data)
    assert where(store, 7) == ["disk"]
    meta, data, _ = stored(8, layers=32)
    with pytest.raises(CapacityExhausted):
        store.put(block_id(8), meta, data)


def test_split_placement_and_merge_on_demotion() -> None:
    store, _, _ = make(host_blocks=2, disk_blocks=4)
    meta, data, octets = stored(1)
    record = store.put(block_id(1), meta, data, placement=[("host", (0, 1)), ("disk", (2, 3))])
    assert [(r.tier, r.layers) for r in record.residency] == [("host", (0, 1)), ("disk", (2, 3))]
    read = store.get(block_id(1))
    assert read.header.encode() + b"".join(read.parts) == octets
    assert len(read.parts) == 2
    put(store, 2)
    put(store, 3)  # host: 1's half + 2 + 3 > 2 blocks: 1's host layers join its disk layers
    assert store.spans(block_id(1)) == {"disk": (0, 3)}
    read = store.get(block_id(1), 1, 3)
    assert read.header.encode() + b"".join(read.parts) == container(1).slice(1, 3).tobytes()
    with pytest.raises(ValueError, match="tier order"):
        store.put(block_id(4), *stored(4)[:2], placement=[("disk", (0, 1)), ("host", (2, 3))])


def test_fault_on_read_withdraws_even_a_leased_block() -> None:
    store, leases, _ = make(host_blocks=0, disk_blocks=2)
    put(store, 1)
    leases.grant("c", [(block_id(1), 1)], 5_000)
    store.take_effects()
    store._data["disk"].bad.add(block_id(1))  # type: ignore[attr-defined]
    used = store.used()["disk"]
    with pytest.raises(NotFound):
        store.get(block_id(1))
    assert block_id(1) not in store
    with pytest.raises(NotFound):  # gone from every query at once
        store.by_key(block_id(1)[2])
    (withdraw,) = store.take_effects()
    assert isinstance(withdraw, Withdraw)
    assert withdraw.then_forget
    assert withdraw.ref.block_key == block_id(1)[2]
    assert store.stats.digest_failures == 1
    # KVSP 6.6: withdrawn first; its octets go only once the withdrawal was delivered
    assert store.used()["disk"] == used
    with pytest.raises(AlreadyStored):  # no new copy under the key until then
        put(store, 1)
    store.forget_withdrawn([block_id(1)])
    assert store.used()["disk"] == 0
    assert not store._data["disk"]._held  # type: ignore[attr-defined]
    store._data["disk"].bad.clear()  # type: ignore[attr-defined]
    put(store, 1)
    assert store.by_key(block_id(1)[2]) == block_id(1)


def test_records_are_refreshed_before_they_expire() -> None:
    store, _, clock = make()
    put(store, 1)
    store.take_effects()
    clock.advance(4_999)
    assert store.refresh_due() == 0
    clock.advance(1)
    assert store.refresh_due() == 1
    assert [type(e) for e in store.take_effects()] == [Publish]
    clock.advance(4_999)
    assert store.refresh_due() == 0
    store.drop(block_id(1))
    clock.advance(10_000)
    assert store.refresh_due() == 0


def test_remaining_ttl_and_configuration_errors() -> None:
    store, _, clock = make()
    put(store, 1)
    clock.advance(3_000)
    assert store.get(block_id(1)).remaining_ttl_ms == 7_000
    no_data: dict[Tier, MemoryTier] = {}
    with pytest.raises(ConfigurationError):
        BlockStore([TierSpec("host", 1)], no_data, LeaseTable(clock, LeaseLimits()), clock, HOLDER)


def test_meta_of_a_partial_container_is_refused() -> None:
    from kvsp.core.problems import ContainerError

    with pytest.raises(ContainerError):
        BlockMeta.of(container(1).slice(1, 3))


@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["put", "get", "lease", "release", "advance"]),
            st.integers(0, 11),
        ),
        max_size=60,
    )
)
def test_leased_blocks_survive_any_pressure_and_capacity_holds(
    ops: list[tuple[str, int]],
) -> None:
    store, leases, clock = make(host_blocks=3, disk_blocks=3)
    lease_ids: dict[int, str] = {}
    for op, n in ops:
        b = block_id(n)
        pinned_before = {x for x in leases.leased_blocks() if x in store}
        if op == "put":
            with contextlib.suppress(AlreadyStored, CapacityExhausted):
                put(store, n)
        elif op == "get" and b in store:
            store.get(b)
        elif op == "lease" and b in store and n not in lease_ids:
            with contextlib.suppress(LeaseQuotaExceeded):
                lease_ids[n] = leases.grant("c", [(b, store.meta(b).size)], 2_000).lease
        elif op == "release" and n in lease_ids:
            with contextlib.suppress(NotFound):  # expired already
                leases.release("c", lease_ids.pop(n))
        elif op == "advance":
            clock.advance(n * 100)
        # a block leased before the operation (and still leased) was not evicted or moved
        for x in pinned_before:
            if leases.leased(x):
                assert x in store
        used = store.used()
        assert used["host"] <= 3 * BLOCK
        assert used["disk"] <= 3 * BLOCK
        assert sum(used.values()) == sum(
            store.meta(x).size - store.meta(x).header(0, 3).header_octets
            for x in (block_id(i) for i in range(12))
            if x in store
        )
        withdrawn = [e for e in store.take_effects() if isinstance(e, Withdraw)]
        for w in withdrawn:
            assert (w.ref.compat_id, w.ref.scope_id, w.ref.block_key) not in store


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["put", "get", "demote", "promote", "drop"]), st.integers(0, 9)),
        max_size=60,
    )
)
def test_each_block_is_charged_its_metadata_once_wherever_it_moves(
    ops: list[tuple[str, int]],
) -> None:
    """With a per-block overhead, the tiers' used octets are always the blocks' data plus one
    overhead each, and never above capacity: many tiny blocks fill a tier by their count."""
    overhead = 300
    store, _, _ = make(host_blocks=3, disk_blocks=3, overhead=overhead)
    for op, n in ops:
        b = block_id(n)
        with contextlib.suppress(AlreadyStored, CapacityExhausted, NotFound):
            if op == "put":
                put(store, n)
            elif op == "get" and b in store:
                store.get(b)
            elif op == "demote" and b in store:
                store.demote(b)
            elif op == "promote" and b in store:
                store.promote(b, n % 4)
            elif op == "drop":
                store.drop(b)
        used = store.used()
        held = [block_id(i) for i in range(10) if block_id(i) in store]
        assert used["host"] <= 3 * (BLOCK + overhead)
        assert used["disk"] <= 3 * (BLOCK + overhead)
        data = sum(store.meta(x).size - store.meta(x).header(0, 3).header_octets for x in held)
        assert sum(used.values()) == data + overhead * len(held)
