"""The connector's counts: what workers add from two threads is taken once, whole, and
aggregates as vLLM aggregates workers' stats."""

from __future__ import annotations

import threading

from hypothesis import given
from hypothesis import strategies as st

from kvsp.integrations.vllm.stats import COUNTS, ConnectorTally, KVSPConnectorStats

counts = st.dictionaries(st.sampled_from(sorted(COUNTS)), st.integers(0, 10**9))


@given(st.lists(counts, max_size=20))
def test_aggregated_stats_are_the_sums_and_empty_stats_are_empty(
    parts: list[dict[str, int]],
) -> None:
    total = KVSPConnectorStats()
    assert total.is_empty()
    for part in parts:
        total.aggregate(KVSPConnectorStats(dict(part)))
    assert total.reduce() == {n: sum(p.get(n, 0) for p in parts) for n in COUNTS}
    assert total.is_empty() == (not any(v for p in parts for v in p.values()))


def test_counts_added_from_threads_are_all_taken_once() -> None:
    tally = ConnectorTally()
    assert tally.take() is None

    def add() -> None:
        for _ in range(10_000):
            tally.add(blocks_loaded=1, bytes_loaded=3)

    threads = [threading.Thread(target=add) for _ in range(4)]
    taken = []
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        if (stats := tally.take()) is not None:
            taken.append(stats)
    if (stats := tally.take()) is not None:
        taken.append(stats)
    total = KVSPConnectorStats()
    for stats in taken:
        total.aggregate(stats)
    assert total.data["blocks_loaded"] == 40_000
    assert total.data["bytes_loaded"] == 120_000
