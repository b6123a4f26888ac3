"""The paged pool: G1 pages (O(1) free list, bit-exact, bounded), reference counts, and the tiered
store with G1 in front of G2 (per-layer residency, LRU demotion G1 -> G2 before any drop,
blocks in use never moved)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.core.problems import CapacityExhausted, ConfigurationError
from kvsp.holder.blocks import BlockId
from kvsp.holder.store import Publish, Withdraw
from kvsp.instance.kvpool import BlockRefs, KvPages
from tests.holder.factories import block_id, stored
from tests.instance.pools import BLOCK, LAYERS, PAGE, pool, put, read, split


def test_pages_round_trip_bit_exact_and_return_to_the_free_list() -> None:
    pages = KvPages(blocks=2, layers=LAYERS, page_octets=PAGE)
    meta, data, _ = stored(1)
    assert pages.free_pages == 8
    pages.write(block_id(1), meta, (0, 3), [data])
    assert pages.free_pages == 4
    assert bytes(pages.read(block_id(1), meta, (0, 3), (0, 3))) == bytes(data)
    assert bytes(pages.read(block_id(1), meta, (0, 3), (2, 3))) == bytes(data[2 * PAGE :])
    pages.delete(block_id(1))
    assert pages.free_pages == 8
    pages.delete(block_id(1))  # deleting twice gives nothing back twice
    assert pages.free_pages == 8


def test_a_read_is_a_copy_that_a_reused_page_cannot_change() -> None:
    pages = KvPages(blocks=1, layers=LAYERS, page_octets=PAGE)
    meta1, data1, _ = stored(1)
    meta2, data2, _ = stored(2)
    pages.write(block_id(1), meta1, (0, 3), [data1])
    out = pages.read(block_id(1), meta1, (0, 3), (0, 3))
    pages.delete(block_id(1))
    pages.write(block_id(2), meta2, (0, 3), [data2])
    assert bytes(out) == bytes(data1)


def test_pages_are_bounded_and_take_only_whole_pages() -> None:
    pages = KvPages(blocks=1, layers=2, page_octets=PAGE)
    meta, data, _ = stored(1)
    with pytest.raises(CapacityExhausted):
        pages.write(block_id(1), meta, (0, 3), [data])
    odd, odd_data, _ = stored(2, section=32)  # another geometry: half a page per layer
    assert not pages.accepts(odd, (0, 3))
    with pytest.raises(ValueError, match="exactly one page"):
        pages.write(block_id(2), odd, (0, 3), [odd_data])
    with pytest.raises(ConfigurationError):
        KvPages(blocks=0, layers=2, page_octets=PAGE)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=60))
def test_pages_never_leak_or_overlap(steps: list[tuple[bool, int]]) -> None:
    """Any sequence of writes and deletes: held pages are distinct and free + held = all."""
    pages = KvPages(blocks=3, layers=LAYERS, page_octets=PAGE)
    held: dict[BlockId, bytes] = {}
    for write, n in steps:
        block = block_id(n)
        if write and (len(held) < 3 or block in held):
            meta, data, _ = stored(n)
            pages.write(block, meta, (0, 3), [data])
            held[block] = bytes(data)
        else:
            pages.delete(block)
            held.pop(block, None)
        assert pages.free_pages == 12 - LAYERS * len(held)
    for block, octets in held.items():
        meta, _, _ = stored(0)
        assert bytes(pages.read(block, meta, (0, 3), (0, 3))) == octets


def test_reference_counts() -> None:
    refs = BlockRefs()
    a, b = block_id(1), block_id(2)
    refs.acquire([a, a, b])
    assert (refs.count(a), refs.count(b)) == (2, 1)
    assert set(refs.leased_blocks()) == {a, b}
    refs.release([a, b])
    assert refs.leased(a)
    assert not refs.leased(b)
    refs.release([a])
    assert not refs.leased(a)
    assert refs.count(a) == 0
    with pytest.raises(ValueError, match="more often"):
        refs.release([a])


def test_lru_demotes_g1_to_g2_before_anything_is_dropped_withdrawing_first() -> None:
    store, pages, _, _ = pool(g1_blocks=2, g2_blocks=1)
    b1, b2 = put(store, 1), put(store, 2)
    assert [store.spans(b) for b in (b1, b2)] == [{"device": (0, 3)}] * 2
    store.get(b1)  # b1 used last: b2 is G1's victim
    store.take_effects()
    b3 = put(store, 3)
    assert store.spans(b2) == {"host": (0, 3)}
    assert store.spans(b3) == {"device": (0, 3)}
    effects = store.take_effects()
    assert [type(e) for e in effects] == [Publish, Publish]  # b2 moved, b3 stored; nothing gone
    assert effects[0].record.residency[0].tier == "host"  # type: ignore[union-attr]
    put(store, 4)  # G1's victim b1 goes to G2, whose own victim b2 is dropped
    assert b2 not in store
    assert store.spans(b1) == {"host": (0, 3)}
    effects = store.take_effects()
    assert isinstance(effects[0], Withdraw)
    assert effects[0].ref.block_key == b2[2]
    assert pages.free_pages == 0
    assert read(store, b1) == bytes(stored(1)[1])  # bit-exact after G1 -> G2


def test_first_layers_in_g1_and_the_rest_in_g2_are_reported_per_layer_range() -> None:
    store, pages, _, _ = pool(g1_blocks=2, g2_blocks=4, g1_layers=3)
    b1 = put(store, 1, split(3))
    record = store.record(b1)
    assert [(r.tier, r.layers, r.read_mbit_per_s) for r in record.residency] == [
        ("device", (0, 2), None),
        ("host", (3, 3), 96_000),
    ]
    assert read(store, b1) == bytes(stored(1)[1])
    assert bytes(b"".join(store.get(b1, 2, 3).parts)) == bytes(stored(1)[1][2 * PAGE :])
    put(store, 2, split(3))
    put(store, 3, split(3))  # G1 holds two blocks' first layers: b1's move to G2, merged
    assert store.spans(b1) == {"host": (0, 3)}
    assert pages.free_pages == 0


def test_blocks_in_use_are_never_moved_and_new_blocks_go_to_g2() -> None:
    store, _, refs, _ = pool(g1_blocks=2, g2_blocks=2)
    b1, b2 = put(store, 1), put(store, 2)
    refs.acquire([b1, b2])
    b3 = put(store, 3)  # G1 is all in use: the new block goes to G2
    assert store.spans(b3) == {"host": (0, 3)}
    assert [store.spans(b) for b in (b1, b2)] == [{"device": (0, 3)}] * 2
    refs.release([b1])
    put(store, 4)
    assert store.spans(b1) == {"host": (0, 3)}  # released: now it may move
    refs.acquire([b3])
    put(store, 5)  # G1: b4 moves to G2, where b1 (not b3, in use) goes
    assert b3 in store
    assert b1 not in store


def test_a_block_g1_cannot_page_goes_to_g2() -> None:
    store, _, _, _ = pool(g1_blocks=2, g2_blocks=2)
    meta, data, _ = stored(9, section=32)
    store.put(block_id(9), meta, data)
    assert store.spans(block_id(9)) == {"host": (0, 3)}
    with pytest.raises(ValueError, match="cannot keep"):
        store.put(block_id(8), *stored(8, section=32)[:2], placement=split(2))


def test_demote_then_promote_moves_layers_bit_exactly() -> None:
    store, pages, _, _ = pool(g1_blocks=2, g2_blocks=2)
    b1 = put(store, 1)
    assert store.demote(b1)
    assert store.spans(b1) == {"host": (0, 3)}
    assert pages.free_pages == 8
    assert not store.demote(b1)  # nothing left in G1
    assert store.promote(b1, last=1)  # the first two layers back into G1
    assert store.spans(b1) == {"device": (0, 1), "host": (2, 3)}
    assert read(store, b1) == bytes(stored(1)[1])
    assert store.promote(b1)
    assert store.spans(b1) == {"device": (0, 3)}
    assert not store.promote(b1)  # already there: a no-op
    assert read(store, b1) == bytes(stored(1)[1])
    assert store.used() == {"device": BLOCK, "host": 0}
    residency = store.take_effects()[-1].record.residency  # type: ignore[union-attr]
    assert [(r.tier, r.layers) for r in residency] == [("device", (0, 3))]


def test_promotion_makes_room_and_protected_blocks_bound_it() -> None:
    store, _, refs, _ = pool(g1_blocks=1, g2_blocks=2)
    b1, b2 = put(store, 1), put(store, 2)  # b1 was G1's victim: now in G2
    assert store.spans(b1) == {"host": (0, 3)}
    assert store.promote(b1)  # b2 makes room for it
    assert store.spans(b2) == {"host": (0, 3)}
    refs.acquire([b1])
    with pytest.raises(CapacityExhausted):
        store.promote(b2)  # G1 holds only a block in use
    assert store.spans(b2) == {"host": (0, 3)}
    put(store, 3)  # G2 holds b2 and b3: both in use now, so b1 cannot be demoted
    refs.acquire([b2, block_id(3)])
    with pytest.raises(CapacityExhausted):
        store.demote(b1)
    assert store.spans(b1) == {"device": (0, 3)}
