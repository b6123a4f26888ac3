"""KvHints on the pool: each action's outcome with its blocks resident in G1, in G2 only, absent,
and over limits; pins stay bounded under memory pressure; the envelope and payloads."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from kvsp.core.clock import ManualClock
from kvsp.core.hints import HintAction, HintOutcome, KvHints, Reason, action_name, parse_payload
from kvsp.holder.blocks import BlockId
from kvsp.holder.store import BlockStore
from kvsp.instance.hints import (
    HintLimits,
    LocalHints,
    PinTable,
    engine_kept,
    engine_prefetch,
)
from kvsp.quotas import Quota, Quotas
from tests.holder.factories import SCOPE, block_id
from tests.instance.pools import pool, put


class Env:
    def __init__(self, g1: int = 2, g2: int = 2, limits: HintLimits | None = None) -> None:
        self.clock = ManualClock()
        self.limits = limits or HintLimits(pin_session_bytes=10_000, pin_total_bytes=10_000)
        self.pins = PinTable(self.clock, self.limits)
        self.store: BlockStore
        self.store, self.pages, self.refs, _ = pool(g1, g2, 4, self.clock, self.pins)
        self.hints = LocalHints(self.store, self.pins, self.limits, None)

    def act(self, kind: str, blocks: list[BlockId], owner: str = "s1", **payload: Any
            ) -> HintOutcome:  # fmt: skip
        target = {"scope_id": SCOPE, "block_keys": [b[2] for b in blocks]}
        action = HintAction(
            action_id="a1",
            action_type=f"kv.{kind}",
            action_version="1.0",
            payload={"target": target, **payload},
        )
        parsed = parse_payload(action)
        assert not isinstance(parsed, str), parsed
        outcome, held = self.hints.prepare(action, parsed, blocks)
        if not held:
            return outcome
        return self.hints.run(kind, outcome, held, parsed, owner)


def action(kind: str) -> HintAction:
    return HintAction(action_id="a1", action_type=f"kv.{kind}", action_version="1.0", payload={})


def tiers(store: BlockStore, block: BlockId) -> list[str]:
    return list(store.spans(block))


def test_demote_from_g1_g2_only_absent_and_without_room() -> None:
    env = Env(g1=2, g2=1)
    b1, b2 = put(env.store, 1), put(env.store, 2)
    out = env.act("demote", [b1])
    assert (out.outcome, out.blocks) == ("accepted", 1)
    assert tiers(env.store, b1) == ["host"]
    assert env.act("demote", [b1]).outcome == "accepted"  # G2 only: nothing to do
    out = env.act("demote", [block_id(9)])
    assert (out.outcome, out.missing) == ("missing", [block_id(9)[2]])
    env.refs.acquire([b1])  # G2's only block is in use: no room for b2's copy
    out = env.act("demote", [b2])
    assert out.outcome == "deferred"
    assert tiers(env.store, b2) == ["device"]  # nothing changed


def test_demoting_one_target_may_drop_another_which_is_then_missing() -> None:
    env = Env(g1=1, g2=1)
    y = put(env.store, 1)
    x = put(env.store, 2)  # y went to G2
    out = env.act("demote", [x, y])  # x's copy in G2 takes y's place: y is dropped
    assert (out.outcome, out.blocks, out.missing) == ("clipped", 1, [y[2]])
    assert tiers(env.store, x) == ["host"]
    assert y not in env.store
    x2 = put(env.store, 3)
    out = env.act("pin", [x2, x], ttl_ms=1_000, tier="g2")
    assert out.outcome == "accepted"
    assert x not in env.store  # dropped for x2's copy: pinned are only those still held
    assert out.blocks == 1


def test_prefetch_promotes_g2_to_g1_and_is_a_no_op_when_resident() -> None:
    env = Env(g1=1, g2=2)
    b1, b2 = put(env.store, 1), put(env.store, 2)  # b1 went to G2 to make room for b2
    assert tiers(env.store, b1) == ["host"]
    out = env.act("prefetch", [b1])
    assert (out.outcome, out.blocks) == ("accepted", 1)
    assert tiers(env.store, b1) == ["device"]
    assert tiers(env.store, b2) == ["host"]
    assert env.act("prefetch", [b1]).outcome == "accepted"  # already in G1
    env.refs.acquire([b1])
    assert env.act("prefetch", [b2]).outcome == "deferred"  # G1 holds a block in use
    out = env.act("prefetch", [b2, block_id(9)])
    assert out.outcome == "deferred"
    assert out.missing == [block_id(9)[2]]


def test_retain_is_clipped_to_limits_and_biases_eviction() -> None:
    env = Env(g1=2, g2=0, limits=HintLimits(max_retain_ms=1_000, max_priority=5))
    b1, b2 = put(env.store, 1), put(env.store, 2)
    out = env.act("retain", [b1], ttl_ms=60_000, priority=50)
    assert (out.outcome, out.ttl_ms, out.priority) == ("clipped", 1_000, 5)
    put(env.store, 3)  # b1 is older but retained: b2 goes
    assert b1 in env.store
    assert b2 not in env.store
    env.clock.advance(1_001)  # the bias is over: b1 is evictable like any other
    put(env.store, 4)
    assert b1 not in env.store
    out = env.act("retain", [block_id(3)], ttl_ms=500, priority=2)
    assert (out.outcome, out.ttl_ms, out.priority) == ("accepted", 500, 2)


def test_pin_protects_until_its_ttl_clipped_and_bounded() -> None:
    env = Env(g1=1, g2=1)
    b1 = put(env.store, 1)
    out = env.act("pin", [b1], ttl_ms=10**9)
    assert (out.outcome, out.ttl_ms, out.code) == ("clipped", env.limits.max_pin_ms, "over-limits")
    assert out.to_json()["code"] == "over-limits"  # for programs; ``reason`` is for people
    put(env.store, 2)  # G1 holds a pinned block: b2 goes to G2
    assert tiers(env.store, b1) == ["device"]
    no_ttl = env.act("pin", [b1])
    assert (no_ttl.outcome, no_ttl.code) == ("rejected", Reason.INVALID)
    env.clock.advance(env.limits.max_pin_ms)  # expired: ordinary eviction again
    put(env.store, 3)
    assert tiers(env.store, b1) == ["host"]
    # making room asked which pins ended (``ended``), which collected the expired one
    assert env.pins.octets_of("s1") == 0
    assert env.pins.octets == 0


def test_pin_in_g2_only_frees_g1() -> None:
    env = Env(g1=2, g2=2)
    b1 = put(env.store, 1)
    out = env.act("pin", [b1], ttl_ms=1_000, tier="g2")
    assert out.outcome == "accepted"
    assert tiers(env.store, b1) == ["host"]
    assert env.pages.free_pages == 8


def test_pins_never_exceed_their_limits_under_memory_pressure() -> None:
    probe = Env()
    size = probe.store.meta(put(probe.store, 1)).size
    env = Env(g1=2, g2=2, limits=HintLimits(pin_session_bytes=2 * size, pin_total_bytes=3 * size))
    blocks = [put(env.store, n) for n in (1, 2)]
    out = env.act("pin", blocks, owner="s1", ttl_ms=5_000)
    assert (out.outcome, out.blocks) == ("accepted", 2)
    more = [put(env.store, n) for n in (3, 4)]
    out = env.act("pin", more, owner="s1", ttl_ms=5_000)
    assert out.outcome == "rejected"  # s1 is at its limit
    out = env.act("pin", more, owner="s2", ttl_ms=5_000)
    assert (out.outcome, out.blocks) == ("clipped", 1)  # the total limit: one more block
    for n in range(5, 30):  # pressure: unpinned blocks come and go, pinned ones stay
        put(env.store, n)
    assert all(b in env.store for b in [*blocks, more[0]])
    assert env.pins.octets <= env.limits.pin_total_bytes
    assert env.pins.release("s1") == 2
    assert env.pins.octets == size


def test_limit_blocks_and_partly_missing_targets_are_clipped() -> None:
    env = Env(g1=4, g2=0)
    blocks = [put(env.store, n) for n in (1, 2, 3)]
    out = env.act("retain", blocks, ttl_ms=100, limit_blocks=2)
    assert (out.outcome, out.blocks) == ("clipped", 2)
    out = env.act("retain", [blocks[0], block_id(8)], ttl_ms=100)
    assert (out.outcome, out.blocks, out.missing) == ("clipped", 1, [block_id(8)[2]])


def test_envelope_action_names_and_payload_errors() -> None:
    envelope = KvHints.model_validate(
        {
            "protocol_version": "0.1",
            "message_id": "m1",
            "actions": [
                {"action_id": "x", "action_type": "kv.fetch", "action_version": "1.0",
                 "payload": {}},
                {"action_id": "y", "action_type": "pin", "action_version": "1.2", "payload": {}},
                {"action_id": "z", "action_type": "kv.pin", "action_version": "2.0",
                 "payload": {}},
            ],
        }
    )  # fmt: skip
    assert [action_name(a) for a in envelope.actions] == [None, "pin", None]
    with pytest.raises(ValidationError):
        KvHints.model_validate({"protocol_version": "0.2", "message_id": "m", "actions": []})

    def pin(payload: dict[str, Any]) -> str:
        action = HintAction(
            action_id="a", action_type="kv.pin", action_version="1.0", payload=payload
        )
        return str(parse_payload(action))

    assert "not both" in pin({"target": {"session": "s", "block_keys": ["00" * 32]}})
    assert "scope_id" in pin({"target": {"block_keys": ["00" * 32]}})
    assert pin({"target": {"session": "s"}, "ttl_ms": -1}).startswith("ttl_ms")
    assert pin({"target": {"session": "s"}, "ttl": 5}).startswith("ttl: Extra")  # misspelt


def test_a_block_two_sessions_pin_stays_pinned_until_both_let_go() -> None:
    env = Env(g1=2, g2=1)
    shared, own = put(env.store, 1), put(env.store, 2)
    size = env.store.meta(shared).size
    assert env.act("pin", [shared, own], owner="s1", ttl_ms=1_000).outcome == "accepted"
    assert env.act("pin", [shared], owner="s2", ttl_ms=5_000).outcome == "accepted"
    assert env.pins.octets_of("s2") == 0  # charged once, to s1
    assert env.pins.release("s1") == 2
    assert env.pins.leased(shared)  # s2 still pins it, and now pays for it
    assert not env.pins.leased(own)
    assert env.pins.octets_of("s2") == size
    env.clock.advance(5_000)
    assert env.pins.expire() == [shared]
    assert env.pins.octets == 0


def test_one_tenant_cannot_take_the_whole_pin_budget() -> None:
    """A tool-call flood of one tenant pins up to its share (the budget over the tenants, or its
    own quota); the other tenant's pins are still accepted."""
    clock = ManualClock()
    limits = HintLimits(pin_session_bytes=1 << 20, pin_total_bytes=4_000)
    pins = PinTable(clock, limits, tenants=2)
    a = [(block_id(n, "a" * 32), 500) for n in range(10)]
    b = [(block_id(n, "b" * 32), 500) for n in range(4)]
    for n, block in enumerate(a):  # a session per block, each under its own limit
        pins.pin(f"a-{n}", [block], 60_000)
    assert pins.octets_by_scope() == {"a" * 32: 2_000}  # half of the budget
    assert pins.pin("b-0", b, 60_000) == [block for block, _ in b]
    assert pins.octets_by_scope() == {"a" * 32: 2_000, "b" * 32: 2_000}
    quotas = Quotas(scopes={"a" * 32: Quota(pinned_octets=1_000)})
    own = PinTable(clock, limits, quotas, tenants=2)
    assert len(own.pin("a", a, 60_000)) == 2  # its own quota
    own.release("a")
    assert own.octets_by_scope() == {}


def test_where_the_engine_keeps_its_own_pages_prefetch_counts_only_what_is_there() -> None:
    env = Env(g1=1, g2=4)  # which of its tiers holds a block does not matter here
    b1, b2 = put(env.store, 1), put(env.store, 2)
    only_g1, absent = block_id(3), block_id(4)
    out = engine_prefetch(action("prefetch"), [b1, only_g1], frozenset({b1, only_g1}), env.store)
    assert (out.outcome, out.blocks, out.code) == ("accepted", 2, None)
    out = engine_prefetch(action("prefetch"), [b1, b2, absent], frozenset({b1}), env.store)
    assert (out.outcome, out.blocks, out.code) == ("clipped", 1, Reason.ENGINE_G1)
    assert out.missing == [absent[2]]
    assert "1 target blocks are in G2 only" in (out.reason or "")
    out = engine_prefetch(action("prefetch"), [b2], frozenset(), env.store)
    assert (out.outcome, out.blocks, out.code) == ("rejected", 0, Reason.ENGINE_G1)
    out = engine_prefetch(action("prefetch"), [b1, absent], frozenset({b1}), env.store)
    assert (out.outcome, out.code) == ("clipped", Reason.NOT_HELD)
    out = engine_prefetch(action("prefetch"), [absent], frozenset(), env.store)
    assert (out.outcome, out.code) == ("missing", Reason.NOT_HELD)


def test_retain_pin_demote_say_which_blocks_the_engine_keeps_by_its_own_order() -> None:
    env = Env(g1=1, g2=4)
    b1 = put(env.store, 1)
    only_g1 = block_id(3)
    out = engine_kept("retain", env.act("retain", [b1], ttl_ms=1_000), frozenset({b1}))
    assert (out.outcome, out.blocks, out.code) == ("clipped", 1, Reason.ENGINE_G1)
    out = engine_kept("retain", env.act("retain", [b1], ttl_ms=1_000), frozenset())
    assert (out.outcome, out.code) == ("accepted", None)  # nothing of it in the engine's pages
    # a block only in the engine's pages is held, by no copy the action can act on
    out = engine_kept("pin", env.act("pin", [b1, only_g1], ttl_ms=1_000), frozenset({only_g1}))
    assert (out.outcome, out.blocks, out.missing) == ("clipped", 1, [])
    assert out.code == Reason.ENGINE_G1
    out = engine_kept("demote", env.act("demote", [only_g1]), frozenset({only_g1}))
    assert (out.outcome, out.blocks, out.code) == ("rejected", 0, Reason.ENGINE_G1)
    # a limit that cut the action says more, and stays
    out = env.act("retain", [b1], ttl_ms=10**9)
    assert engine_kept("retain", out, frozenset({b1})).code == Reason.OVER_LIMITS
