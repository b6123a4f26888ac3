"""The paged KV pool: exact eviction order, reference counts, demotion, prefixes, events."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.core.problems import CapacityExhausted
from kvsp.instance.kvpool import Admitted, Demoted, Evicted, KvPool, Prefix


def keys(*ns: int) -> list[str]:
    return [f"k{n}" for n in ns]


def test_lru_eviction_order_with_demotion_to_g2_then_drop() -> None:
    pool = KvPool(g1_blocks=2, g2_blocks=2)
    for k in keys(1, 2):
        pool.admit(k)
    assert pool.eviction_order("g1") == keys(1, 2)
    pool.acquire(keys(1))
    pool.release(keys(1))  # k1 used last: k2 goes first now
    assert pool.eviction_order("g1") == keys(2, 1)
    pool.take_events()
    pool.admit("k3")
    assert pool.take_events() == [
        Demoted("k2"),
        Admitted("k2", "g2"),
        Evicted("k2", "g1", gone=False),
        Admitted("k3", "g1"),
    ]
    assert pool.tiers("k2") == ("g2",)
    pool.admit("k4")  # k1 demoted; G2 holds k2, k1
    pool.admit("k5")  # k3 demoted: G2 full, so its first victim (k2) is dropped
    events = pool.take_events()
    assert Evicted("k2", "g2", gone=True) in events
    assert "k2" not in pool
    assert pool.eviction_order("g2") == keys(1, 3)
    assert (pool.used("g1"), pool.used("g2")) == (2, 2)


def test_blocks_in_use_are_never_evicted() -> None:
    pool = KvPool(g1_blocks=2, g2_blocks=0)
    pool.admit("k1")
    pool.admit("k2")
    pool.acquire(keys(1, 2))
    with pytest.raises(CapacityExhausted):
        pool.admit("k3")
    assert pool.tiers("k1") == ("g1",)
    pool.release(keys(2))
    pool.admit("k3")
    assert "k2" not in pool
    assert pool.refs("k1") == 1


def test_longest_prefix_prefers_g1_then_g2() -> None:
    pool = KvPool(g1_blocks=4, g2_blocks=4)
    for k in keys(1, 2):
        pool.admit(k)
    pool.admit("k3", "g2")
    assert pool.longest_prefix(keys(1, 2, 3, 4)) == Prefix(g1=2, g2=1)
    pool.free_g1("k1")  # k1 is nowhere else: gone
    assert pool.longest_prefix(keys(1, 2, 3)) == Prefix(0, 0)
    pool.admit("k1", "g2")
    assert pool.longest_prefix(keys(1, 2, 3)).total == 3


def test_misuse_is_refused() -> None:
    pool = KvPool(1, 1)
    with pytest.raises(KeyError):
        pool.acquire(keys(9))
    pool.admit("k1")
    with pytest.raises(ValueError, match="not in use"):
        pool.release(keys(1))


@given(
    st.lists(
        st.tuples(st.sampled_from(["admit", "admit2", "use", "done", "free"]), st.integers(0, 9)),
        max_size=80,
    )
)
def test_capacities_and_references_always_hold(ops: list[tuple[str, int]]) -> None:
    pool = KvPool(g1_blocks=3, g2_blocks=3)
    in_use: dict[str, int] = {}
    for op, n in ops:
        key = f"k{n}"
        try:
            if op == "admit":
                pool.admit(key)
            elif op == "admit2":
                pool.admit(key, "g2")
            elif op == "use" and key in pool:
                pool.acquire([key])
                in_use[key] = in_use.get(key, 0) + 1
            elif op == "done" and in_use.get(key):
                pool.release([key])
                in_use[key] -= 1
            elif op == "free":
                pool.free_g1(key)
        except CapacityExhausted:
            pass
        assert pool.used("g1") <= 3
        assert pool.used("g2") <= 3
        for k, count in in_use.items():
            if count:
                assert k in pool  # a block in use is never evicted
                assert pool.refs(k) == count
        gone = {e.key for e in pool.take_events() if isinstance(e, Evicted) and e.gone}
        assert not any(k in pool for k in gone)
