"""The replica table with a manual clock: prefix lookup, expiry, the TTL cap, limits."""

from __future__ import annotations

import gc
import json
import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.core.clock import ManualClock
from kvsp.core.cost import ReplicaSummary
from kvsp.core.problems import CapacityExhausted
from kvsp.core.records import ReplicaRecord
from kvsp.index import replicas
from kvsp.index.keytable import COMPILED
from kvsp.index.replicas import ReplicaTable, array_of, holder_runs, summary_of
from kvsp.index.rules import (
    IndexLimits,
)
from tests.index.factories import (
    COMPAT,
    H1,
    H2,
    I1,
    I2,
    SCOPE_A,
    SCOPE_B,
    keys,
    ref,
    replica,
)


@given(st.lists(st.sets(st.sampled_from([H1, H2, I1, I2]), min_size=1), max_size=8))
def test_holder_runs_count_each_holders_unbroken_leading_blocks(held: list[set[str]]) -> None:
    table = ReplicaTable(ManualClock(), IndexLimits(max_records=100))
    for n, holders in enumerate(held):
        for holder in holders:
            table.publish(replica(n, holder=holder))
    runs = holder_runs(table.lookup(COMPAT, SCOPE_A, keys(*range(len(held)))))
    expected = {}
    for holder in {H1, H2, I1, I2}:
        leading = next((n for n, holders in enumerate(held) if holder not in holders), len(held))
        if leading:
            expected[holder] = leading
    assert dict(runs) == expected
    assert [n for _, n in runs] == sorted(expected.values(), reverse=True)


def test_lookup_stops_at_the_first_miss(table: ReplicaTable) -> None:
    for n in (0, 1, 3):
        table.publish(replica(n))
    found = table.lookup(COMPAT, SCOPE_A, keys(0, 1, 2, 3))
    assert len(found) == 2
    none = table.lookup(COMPAT, SCOPE_A, keys(2, 3))
    assert none == []


def test_scopes_and_compats_are_separate(table: ReplicaTable) -> None:
    table.publish(replica(0, scope=SCOPE_A))
    assert table.lookup(COMPAT, SCOPE_B, keys(0)) == []
    assert table.lookup("00" * 32, SCOPE_A, keys(0)) == []


def test_records_of_every_holder_are_returned(table: ReplicaTable, clock: ManualClock) -> None:
    table.publish(replica(0, holder=H1))
    table.publish(replica(0, holder=H2))
    found = table.lookup(COMPAT, SCOPE_A, keys(0))
    assert sorted(r["holder"] for r in json.loads(array_of(found[0]))) == [H1, H2]


def test_a_block_array_stays_right_as_its_replicas_change(table: ReplicaTable) -> None:
    holders = [H1, H2, I1, I2]
    for n, holder in enumerate(holders):
        table.publish(replica(0, holder=holder, ttl_ms=1_000 + n))
    table.withdraw(ref(0, holder=H2))
    table.publish(replica(0, holder=I1, ttl_ms=5_000))  # refreshed: moves to the end
    table.publish(replica(0, holder=H2, ttl_ms=2_000))
    (block,) = table.lookup(COMPAT, SCOPE_A, keys(0))
    served = [ReplicaRecord.parse(r) for r in json.loads(array_of(block))]
    assert [(r.holder, r.ttl_ms) for r in served] == [
        (H1, 1_000),
        (I2, 1_003),
        (I1, 5_000),
        (H2, 2_000),
    ]
    assert served[1] == replica(0, holder=I2, ttl_ms=1_003)


@pytest.mark.parametrize("render_at_publish", [True, False])
def test_served_json_is_the_record_with_the_granted_ttl(
    clock: ManualClock, render_at_publish: bool
) -> None:
    table = ReplicaTable(clock, IndexLimits(max_ttl_ms=10_000, max_records=100), render_at_publish)
    record = replica(0, ttl_ms=50_000)
    table.publish(record)
    clock.advance(1_200)
    found = table.lookup(COMPAT, SCOPE_A, keys(0))
    served = json.loads(array_of(found[0]))
    assert [ReplicaRecord.parse(r) for r in served] == [
        record.model_copy(update={"ttl_ms": 10_000})
    ]


def test_expiry_and_ttl_cap(table: ReplicaTable, clock: ManualClock) -> None:
    short = table.publish(replica(0, ttl_ms=1_000))
    capped = table.publish(replica(1, ttl_ms=50_000))
    assert (short.ttl_ms, capped.ttl_ms) == (1_000, 10_000)
    clock.advance(999)
    assert len(table.lookup(COMPAT, SCOPE_A, keys(0, 1))) == 2
    clock.advance(1)
    assert table.lookup(COMPAT, SCOPE_A, keys(0, 1)) == []
    assert len(table.lookup(COMPAT, SCOPE_A, keys(1))) == 1
    assert table.count == 1
    clock.advance(9_000)
    assert table.count == 0
    assert table.expired_total == 2


def test_refresh_is_idempotent_and_extends(table: ReplicaTable, clock: ManualClock) -> None:
    first = table.publish(replica(0, ttl_ms=1_000))
    clock.advance(900)
    again = table.publish(replica(0, ttl_ms=1_000))
    assert (first.created, again.created) == (True, False)
    assert table.count == 1
    clock.advance(900)
    assert len(table.lookup(COMPAT, SCOPE_A, keys(0))) == 1
    clock.advance(100)
    assert table.lookup(COMPAT, SCOPE_A, keys(0)) == []
    assert table.expired_total == 1


def test_holder_urls_are_compared_canonically(table: ReplicaTable) -> None:
    table.publish(replica(0, holder="HTTP://127.0.0.1:9101/kvsp"))
    assert not table.publish(replica(0, holder=H1)).created
    assert table.withdraw(ref(0, holder=H1))
    assert table.count == 0


def test_withdraw(table: ReplicaTable) -> None:
    table.publish(replica(0, holder=H1))
    table.publish(replica(0, holder=H2))
    assert table.withdraw(ref(0, holder=H1))
    assert not table.withdraw(ref(0, holder=H1))
    found = table.lookup(COMPAT, SCOPE_A, keys(0))
    assert [r["holder"] for r in json.loads(array_of(found[0]))] == [H2]
    assert table.counts_by_scope() == {SCOPE_A: 1}


def test_record_limit_is_507_and_stores_nothing(clock: ManualClock) -> None:
    table = ReplicaTable(clock, IndexLimits(max_records=3))
    table.publish_many([replica(0), replica(1)])
    with pytest.raises(CapacityExhausted, match="limit of 3"):
        table.publish_many([replica(2), replica(3)])
    assert table.count == 2
    assert not table.publish(replica(1)).created  # refreshing needs no room
    table.publish(replica(2))
    with pytest.raises(CapacityExhausted):
        table.publish(replica(3))
    clock.advance(600_000)
    table.publish(replica(3))  # expiry made room


def test_expiry_costs_only_the_expired(clock: ManualClock) -> None:
    table = ReplicaTable(clock, IndexLimits(max_ttl_ms=10**9, max_records=10**6))
    table.publish_many([replica(n, ttl_ms=10**8) for n in range(5_000)])
    table.publish(replica(99_999, ttl_ms=10))
    clock.advance(10)
    assert table.expire() == clock.now_ms()
    assert table.expired_total == 1
    # the heap still holds one entry per live record: nothing was scanned or rebuilt
    assert len(table._deadlines) == 5_000
    assert table.count == 5_000


def test_refresh_storm_keeps_the_deadline_heap_bounded(table: ReplicaTable) -> None:
    for _ in range(5_000):
        table.publish(replica(0))
    assert len(table._deadlines) <= 2 * table.count + 1024


def test_stored_records_are_out_of_the_collector_and_still_freed(clock: ManualClock) -> None:
    """No full collection walks the records (decision 0025), and a record let go is freed
    though the collector never sees it: publish, refresh and withdraw in rounds hold no more
    memory than one round."""
    table = ReplicaTable(clock, IndexLimits(max_ttl_ms=10_000, max_records=10_000))

    def one_round() -> None:
        table.publish_many([replica(n, holder=h) for n in range(500) for h in (H1, H2)])
        table.publish_many([replica(n) for n in range(500)])  # refreshes
        found = table.lookup(COMPAT, SCOPE_A, keys(*range(500)))
        assert len(found) == 500
        objects = [table._spaces[(COMPAT, SCOPE_A)], table._deadlines]
        objects += [found[0].replicas, *found[0].replicas]
        assert [gc.is_tracked(o) for o in objects] == [not COMPILED] * len(objects)
        gc.collect()
        assert table.answer(COMPAT, SCOPE_A, keys(0, 1))[0] == 2
        for n in range(500):
            table.withdraw(ref(n))
            table.withdraw(ref(n, holder=H2))
        assert table.count == 0

    one_round()
    tracemalloc.start()
    try:
        one_round()
        first, _ = tracemalloc.get_traced_memory()
        for _ in range(5):
            one_round()
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after - first < 100_000, (first, after)


def test_a_skeleton_goes_with_the_last_record_that_uses_it(
    table: ReplicaTable, clock: ManualClock
) -> None:
    """Records that differ in more than their digests (here their TTLs) each bring a skeleton;
    refreshes, withdrawals and expiry take every one away with its last record."""
    table.publish_many([replica(n, ttl_ms=1_000 + n) for n in range(50)])
    table.publish_many([replica(n, holder=H2, ttl_ms=1_000) for n in range(50)])
    assert len(table._skeletons) == 51
    table.publish_many([replica(n, ttl_ms=2_000) for n in range(50)])  # refreshed, alike now
    assert len(table._skeletons) == 2
    for n in range(50):
        table.withdraw(ref(n, holder=H2))
    assert len(table._skeletons) == 1
    (block,) = table.lookup(COMPAT, SCOPE_A, keys(7))
    assert [ReplicaRecord.parse(r) for r in json.loads(array_of(block))] == [
        replica(7, ttl_ms=2_000)
    ]
    clock.advance(2_000)
    assert table.count == 0
    assert len(table._skeletons) == 0


def test_the_summaries_remembered_are_bounded_and_each_replica_keeps_its_own(
    table: ReplicaTable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A publisher that varies every record's size leaves at most ``MAX_SHAPES`` summaries
    remembered; each stored replica keeps the summary of its own record."""
    monkeypatch.setattr(replicas, "MAX_SHAPES", 3)
    sizes = [replica(0).size + n for n in range(10)]
    table.publish_many([replica(n, size=size) for n, size in enumerate(sizes)])
    assert len(table._summary_of) <= 3
    assert len(table._summaries) <= 3
    for n, size in enumerate(sizes):
        (block,) = table.lookup(COMPAT, SCOPE_A, keys(n))
        assert summary_of(block) == ReplicaSummary.of(replica(n, size=size))  # type: ignore[arg-type]
