"""Which KVSP blocks vLLM's pages hold, from its events: a block is in G1 exactly while some
held page carries it, whatever the order of the connector's keying and vLLM's events; every
change is reported once; the tables stay bounded."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvsp.holder.blocks import BlockId
from kvsp.integrations.vllm.g1 import G1Change, G1Pages

PAGES = 6


def blocks_of(page: int) -> list[BlockId]:
    """Pages 0 and 1 share a block (two requests' pages with the same shared-prefix block)."""
    return [("c", "s", f"k{page}a"), ("c", "s", "shared" if page < 2 else f"k{page}b")]


ops = st.lists(
    st.one_of(
        st.tuples(st.just("record"), st.integers(0, PAGES - 1)),
        st.tuples(st.just("stored"), st.integers(0, PAGES - 1)),
        st.tuples(st.just("removed"), st.integers(0, PAGES - 1)),
        st.tuples(st.just("cleared"), st.just(0)),
    ),
    max_size=40,
)


@given(ops)
def test_g1_holds_what_held_and_keyed_pages_carry_and_reports_each_change(
    steps: list[tuple[str, int]],
) -> None:
    pages = G1Pages(capacity=100)
    reported: set[BlockId] = set()

    def watch(changes: list[G1Change]) -> None:
        for block, held in changes:
            assert (block in reported) != held  # a change, never a repeat
            (reported.add if held else reported.discard)(block)

    pages.watch(watch)
    keyed: set[int] = set()
    held: set[int] = set()
    for op, page in steps:
        if op == "record":
            pages.record(page, blocks_of(page))
            keyed.add(page)
        elif op == "stored":
            pages.stored([page])
            held.add(page)
        elif op == "removed":
            pages.removed([page])
            held.discard(page)
        else:
            pages.cleared()
            held.clear()
        expected = {b for p in keyed & held for b in blocks_of(p)}
        assert {b for b in expected if pages.holds(b)} == expected
        assert len(pages) == len(expected)
        assert reported == expected


def test_a_late_watcher_starts_from_what_is_held_and_the_tables_stay_bounded() -> None:
    pages = G1Pages(capacity=2)
    for page in range(4):
        pages.stored([page])
        pages.record(page, blocks_of(page))
    seen: list[G1Change] = []
    pages.watch(seen.extend)
    # only the last two pages are remembered; forgetting a page reported its blocks gone
    assert {b for b, held in seen if held} == {*blocks_of(2), *blocks_of(3)}
    assert len(pages) == 4
    pages.removed([0, 1, 2, 3])
    assert len(pages) == 0
