"""The session index kept in step with two sources of residency, the pool (the holder's publish
and withdraw effects) and the engine's own pages (vLLM's G1): a block's tiers are their union
whatever order the reports come in, ``eviction`` comes only when the last local copy goes, and
the session's frontier then moves back to the deepest block still held."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvsp.core.clock import ManualClock
from kvsp.holder.blocks import BlockId
from kvsp.holder.client import HolderClient
from kvsp.holder.service import HolderConfig, HolderService
from kvsp.holder.store import Publish, Withdraw
from kvsp.instance.hints import HintLimits, PinTable
from kvsp.instance.kvpool import BlockRefs
from kvsp.instance.session_kv import SessionKv
from tests.index.factories import COMPAT, SCOPE_A, key, ref, replica


def session_kv() -> SessionKv:
    clock = ManualClock()
    holder = HolderService(HolderConfig(url="http://127.0.0.1:2/kvsp/", host_bytes=1 << 20), clock)
    pins = PinTable(clock, HintLimits())
    return SessionKv(holder, HolderClient(None), BlockRefs(), pins, None, True, engine_g1=True)


def block(n: int) -> BlockId:
    return (COMPAT, SCOPE_A, key(n))


def tiers_of(kv: SessionKv, n: int) -> list[str] | None:
    """The block's tiers by the event log (None: evicted, or never reported)."""
    last = None
    for event in kv.events.after(0, 1000).events:
        if event.get("block_key") == key(n) and event["kind"] in ("residency", "eviction"):
            last = event.get("tiers")
    return last


def test_g1_and_g2_reports_combine_and_the_frontier_moves_when_the_last_copy_goes() -> None:
    kv = session_kv()
    kv.completed("s", block(1), None)
    kv.completed("s", block(2), block(1))
    kv.observe([Publish(replica(1)), Publish(replica(2))])
    kv.engine_changed([(block(1), True), (block(2), True)])
    assert kv.index is not None
    assert kv.index.tiers(block(2)) == {"g1", "g2"}
    assert tiers_of(kv, 2) == ["g1", "g2"]
    assert kv.index.frontiers("s") == {block(2)}
    kv.engine_changed([(block(2), False)])  # vLLM evicted its page: the G2 copy stays
    assert kv.index.tiers(block(2)) == {"g2"}
    kinds = [e["kind"] for e in kv.events.after(0, 1000).events]
    assert "eviction" not in kinds
    kv.observe([Withdraw(ref(2))])  # and the holder its copy: the last local copy is gone
    assert tiers_of(kv, 2) is None
    assert kv.index.frontiers("s") == {block(1)}
    assert list(kv.index.check()) == []


reports = st.lists(
    st.tuples(st.sampled_from(["publish", "withdraw", "g1-in", "g1-out"]), st.integers(1, 3)),
    max_size=30,
)


@given(reports)
def test_the_tiers_are_the_union_of_both_sources_in_any_order(
    steps: list[tuple[str, int]],
) -> None:
    kv = session_kv()
    for n in (1, 2, 3):
        kv.completed("s", block(n), block(n - 1) if n > 1 else None)
    g1: set[int] = set()
    g2: set[int] = set()
    for what, n in steps:
        if what == "publish":
            kv.observe([Publish(replica(n))])
            g2.add(n)
        elif what == "withdraw":
            kv.observe([Withdraw(ref(n))])
            g2.discard(n)
        else:
            kv.engine_changed([(block(n), what == "g1-in")])
            (g1.add if what == "g1-in" else g1.discard)(n)
    for n in (1, 2, 3):
        expected = [tier for tier, held in (("g1", n in g1), ("g2", n in g2)) if held]
        assert (tiers_of(kv, n) or []) == expected
    assert kv.index is not None
    assert list(kv.index.check()) == []
