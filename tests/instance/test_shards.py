"""A member's token-range holdings through reshard plans (KVSP 6.9), without the model."""

from __future__ import annotations

import pytest

from kvsp.core.container import Container
from kvsp.core.problems import IllegalTransition, LayersUnavailable, NotFound
from kvsp.core.records import ReshardPlan
from kvsp.instance.shards import HeldRange, ShardHoldings, cut

PER_TOKEN = 8  # octets per token per section


def kv(first: int, last: int) -> Container:
    """Two layers whose octets name their token: token t is PER_TOKEN copies of t % 256."""
    sections = []
    for layer in range(2):
        k = b"".join(bytes([(t + layer) % 256]) * PER_TOKEN for t in range(first, last))
        v = b"".join(bytes([(t + layer + 100) % 256]) * PER_TOKEN for t in range(first, last))
        sections.append((k, v))
    return Container.build(0, last - first, sections)


def plan(**members: object) -> ReshardPlan:
    return ReshardPlan.parse({"map": "m", "from": 1, "to": 2, "deadline_ms": 100, **members})


def test_retained_ranges_are_views_and_fetched_ones_join_on_commit() -> None:
    holdings = ShardHoldings()
    original = HeldRange((0, 10), kv(0, 10))
    holdings.load("m", 1, [original])
    holdings.begin(
        plan(
            retain=[[0, 6]],
            fetch=[{"tokens": [10, 14], "from": "http://x/kvsp/"}],
            release=[[6, 10]],
        )
    )
    holdings.fetched("m", HeldRange((10, 14), kv(10, 14)))
    assert holdings.version("m") == 1  # v stays until the commit
    holdings.commit("m", 2)
    assert holdings.ranges("m") == [(0, 6), (10, 14)]
    kept = holdings.read("m", (0, 6))
    assert kept.kv.layers[0].k.obj is original.kv.layers[0].k.obj  # the same memory: no copy
    assert holdings.transferred == kv(10, 14).size
    assert cut(original, (0, 6)).kv.tobytes() == kv(0, 6).tobytes()


def test_abort_leaves_version_v_and_drops_what_was_fetched() -> None:
    holdings = ShardHoldings()
    holdings.load("m", 1, [HeldRange((0, 10), kv(0, 10))])
    holdings.begin(plan(retain=[[0, 10]], fetch=[{"tokens": [10, 12], "from": "http://x/kvsp/"}]))
    holdings.fetched("m", HeldRange((10, 12), kv(10, 12)))
    holdings.abort("m", 2)
    assert holdings.version("m") == 1
    assert holdings.ranges("m") == [(0, 10)]
    with pytest.raises(IllegalTransition):
        holdings.commit("m", 2)


def test_reads_join_consecutive_pieces_and_refuse_gaps() -> None:
    holdings = ShardHoldings()
    holdings.load("m", 1, [HeldRange((0, 4), kv(0, 4)), HeldRange((4, 9), kv(4, 9))])
    assert holdings.read("m", (2, 7)).kv.tobytes() == kv(2, 7).tobytes()
    with pytest.raises(LayersUnavailable):
        holdings.read("m", (5, 12))


def test_plans_for_ranges_not_held_or_other_versions_are_refused() -> None:
    holdings = ShardHoldings()
    holdings.load("m", 1, [HeldRange((0, 4), kv(0, 4))])
    with pytest.raises(IllegalTransition):
        holdings.begin(plan(retain=[[0, 8]]))
    with pytest.raises(IllegalTransition):
        holdings.fetched("m", HeldRange((4, 8), kv(4, 8)))  # no plan open
    holdings.load("m", 3, [])
    with pytest.raises(IllegalTransition):
        holdings.begin(plan())


def test_a_commit_or_abort_for_a_map_never_held_here_is_not_found() -> None:
    holdings = ShardHoldings()
    with pytest.raises(NotFound):
        holdings.abort("never-seen", 10**18)
    with pytest.raises(NotFound):
        holdings.commit("never-seen", 1)
