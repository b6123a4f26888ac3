"""Pages announced as stored at the holder once every KVSP block in them is, whichever of the
scheduler's keying and the worker's report comes first; each once."""

from __future__ import annotations

from kvsp.integrations.vllm.stored import HolderPages, StoredPage


def test_a_page_is_announced_once_all_its_blocks_are_stored() -> None:
    pages = HolderPages(16)
    pages.record(100, None, (1, 2, 3, 4), [11, 12])
    pages.stored([11])
    assert pages.take() == []
    pages.stored([12])
    assert pages.take() == [StoredPage(100, None, (1, 2, 3, 4))]
    pages.record(100, None, (1, 2, 3, 4), [11, 12])  # keyed again: already announced
    assert pages.take() == []
    pages.stored([21, 22])  # stored before the page was keyed
    pages.record(200, 100, (5, 6, 7, 8), [21, 22])
    assert pages.take() == [StoredPage(200, 100, (5, 6, 7, 8))]


def test_both_tables_stay_bounded() -> None:
    pages = HolderPages(2)
    for n in range(10):
        pages.record(n, None, (n,), [1000 + n])
        pages.stored([5000 + n])
    pages.stored([1009])
    assert pages.take() == [StoredPage(9, None, (9,))]
    assert len(pages._pages) <= 2
    assert len(pages._early) <= 2
