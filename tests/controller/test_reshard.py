"""Resharding (KVSP 6.9): plans, the coordinator, and the plan generator."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.controller.reshard import (
    ReshardCoordinator,
    even_map,
    plan_reshard,
    propose,
    transferred_tokens,
)
from kvsp.core.clock import ManualClock
from kvsp.core.problems import IllegalTransition, InvalidInput, RecordError
from kvsp.core.records import ShardMap
from tests.controller.factories import shard_map

II = [f"http://127.0.0.1:93{n:02d}/kvsp/" for n in range(8)]


def test_6_9_the_example_of_the_spec() -> None:
    old = shard_map(4, (0, 32768, II[1]), (32768, 65536, II[2]), (65536, 98304, II[3]))
    new = shard_map(5, (0, 49152, II[1]), (49152, 98304, II[3]))
    plans = plan_reshard(old, new, 200)
    p1 = plans[II[1]]
    assert p1.retain == ((0, 32768),)
    assert [(f.tokens, f.from_) for f in p1.fetch] == [((32768, 49152), II[2])]
    assert p1.release == ()
    assert plans[II[2]].release == ((32768, 65536),)
    assert plans[II[2]].retain == ()
    p3 = plans[II[3]]
    assert p3.retain == ((65536, 98304),)
    assert [(f.tokens, f.from_) for f in p3.fetch] == [((49152, 65536), II[2])]
    assert transferred_tokens(plans) == 32768


def test_6_9_new_tokens_beyond_version_v_are_not_fetched() -> None:
    old = shard_map(1, (0, 100, II[0]))
    new = shard_map(2, (0, 100, II[0]), (100, 200, II[1]))
    plans = plan_reshard(old, new, 50)
    assert plans[II[1]].fetch == ()
    assert plans[II[0]].retain == ((0, 100),)


def test_6_9_maps_with_gaps_or_overlaps_are_refused() -> None:
    with pytest.raises(RecordError):
        shard_map(1, (0, 100, II[0]), (120, 200, II[1]))
    with pytest.raises(RecordError):
        shard_map(1, (0, 100, II[0]), (50, 200, II[1]))
    with pytest.raises(InvalidInput):
        plan_reshard(shard_map(1, (0, 10, II[0])), shard_map(3, (0, 10, II[1])), 10)


def coordinator() -> tuple[ReshardCoordinator, ManualClock, ShardMap]:
    clock = ManualClock()
    c = ReshardCoordinator(clock)
    v4 = shard_map(4, (0, 100, II[0]), (100, 200, II[1]))
    c.register(v4)
    return c, clock, v4


def test_6_9_version_v_stays_authoritative_until_every_member_acknowledged() -> None:
    c, _, v4 = coordinator()
    v5 = shard_map(5, (0, 150, II[0]), (150, 200, II[2]))
    plans = c.begin(v5, 200)
    assert set(plans) == {II[0], II[1], II[2]}
    assert c.acknowledge("m1", II[0], 5) is None
    assert c.acknowledge("m1", II[1], 5) is None
    assert c.current("m1") == v4
    result = c.acknowledge("m1", II[2], 5)
    assert result is not None
    assert result.commit
    assert set(result.members) == set(plans)
    assert c.current("m1") == v5


def test_6_9_a_member_that_misses_the_deadline_aborts_and_v_stays() -> None:
    c, clock, v4 = coordinator()
    c.begin(shard_map(5, (0, 150, II[0]), (150, 200, II[1])), 200)
    c.acknowledge("m1", II[0], 5)
    clock.advance(200)
    (aborted,) = c.expire()
    assert not aborted.commit
    assert aborted.version == 5
    assert c.current("m1") == v4
    with pytest.raises(IllegalTransition):
        c.acknowledge("m1", II[1], 5)  # nothing in flight any more


def test_6_9_a_member_failing_mid_reshard_aborts() -> None:
    c, _, v4 = coordinator()
    c.begin(shard_map(5, (0, 150, II[0]), (150, 200, II[1])), 200)
    (aborted,) = c.member_failed(II[1])
    assert not aborted.commit
    assert c.current("m1") == v4
    assert c.in_flight("m1") is None


def test_acknowledgements_for_versions_not_in_flight_are_refused() -> None:
    c, _, _ = coordinator()
    with pytest.raises(IllegalTransition):
        c.acknowledge("m1", II[0], 5)
    c.begin(shard_map(5, (0, 150, II[0]), (150, 200, II[1])), 200)
    with pytest.raises(IllegalTransition):
        c.acknowledge("m1", II[0], 6)
    with pytest.raises(IllegalTransition):
        c.acknowledge("m1", II[5], 5)
    with pytest.raises(IllegalTransition):
        c.begin(shard_map(5, (0, 200, II[0])), 200)  # one change at a time


def test_generator_grows_shrinks_and_rebalances_with_the_fewest_moves() -> None:
    v1 = even_map("m", 1, II[:3], 300)
    grown = propose(v1, [*II[:3], II[3]])
    assert grown.version == 2
    assert len(grown.shards) == 4
    moved = transferred_tokens(plan_reshard(v1, grown, 1))
    for k in range(4):  # no other position for the newcomer moves fewer tokens
        order = [*II[:3]]
        order.insert(k, II[3])
        assert moved <= transferred_tokens(plan_reshard(v1, even_map("m", 2, order, 300), 1))
    shrunk = propose(v1, [II[0], II[2]])
    assert [s.instance for s in shrunk.shards] == [II[0], II[2]]
    same = propose(v1, II[:3])
    assert transferred_tokens(plan_reshard(v1, same, 1)) == 0


@given(
    old_cuts=st.lists(st.integers(1, 999), min_size=0, max_size=6, unique=True),
    new_cuts=st.lists(st.integers(1, 999), min_size=0, max_size=6, unique=True),
    old_owners=st.lists(st.integers(0, 5), min_size=7, max_size=7),
    new_owners=st.lists(st.integers(0, 5), min_size=7, max_size=7),
)
def test_6_9_a_retained_range_is_never_transferred(
    old_cuts: list[int], new_cuts: list[int], old_owners: list[int], new_owners: list[int]
) -> None:
    def build(version: int, cuts: list[int], owners: list[int]) -> ShardMap:
        bounds = [0, *sorted(cuts), 1000]
        shards = [(bounds[i], bounds[i + 1], II[owners[i]]) for i in range(len(bounds) - 1)]
        return shard_map(version, *shards)

    old, new = build(1, old_cuts, old_owners), build(2, new_cuts, new_owners)
    plans = plan_reshard(old, new, 100)
    for instance, plan in plans.items():
        owned_before = [s.tokens for s in old.shards if s.instance == instance]
        owned_after = [s.tokens for s in new.shards if s.instance == instance]
        for f in plan.fetch:  # nothing fetched is something the instance already had
            assert all(f.tokens[1] <= a or f.tokens[0] >= b for a, b in owned_before)
            assert f.from_ != instance
        covered = sorted([*plan.retain, *(f.tokens for f in plan.fetch)])
        merged = []
        for lo, hi in covered:
            if merged and merged[-1][1] == lo:
                merged[-1] = (merged[-1][0], hi)
            else:
                merged.append((lo, hi))
        want = []
        for lo, hi in sorted(owned_after):
            if want and want[-1][1] == lo:
                want[-1] = (want[-1][0], hi)
            else:
                want.append((lo, hi))
        assert merged == want  # it ends up with exactly its new ranges
    c = ReshardCoordinator(ManualClock())
    c.register(old)
    c.begin(new, 10)
    (aborted,) = c.member_failed(next(iter(plans)))
    assert not aborted.commit
    assert c.current("m1") == old
