"""The controller's hint policy: pins for tool gaps from the session's own history, demotion for
long gaps and refused pins, retention while the user types, share on a move, outcomes fed back."""

from __future__ import annotations

from typing import Any

from kvsp.controller.hints import GapEstimator, PinOrDemote, PlannedHint, SessionHintTable

A = "http://a.test/kvsp/"
B = "http://b.test/kvsp/"


def kinds(planned: list[PlannedHint]) -> list[tuple[str, str, Any]]:
    return [(p.instance, p.action_type, p.payload.get("ttl_ms")) for p in planned]


def test_a_tool_gap_pins_for_the_expected_gap_with_a_margin() -> None:
    table = SessionHintTable(PinOrDemote(estimator=GapEstimator(prior_ms=10_000)))
    table.turn_started("s", A, 0)
    # no history: the prior (10 s) x 1.5 + 2 s
    assert kinds(table.turn_ended("s", A, 1_000, tool_call=True)) == [(A, "kv.pin", 17_000)]
    # the caller knows better
    assert kinds(table.turn_ended("s", A, 1_000, True, expected_gap_ms=4_000)) == [
        (A, "kv.pin", 8_000)
    ]
    planned = table.turn_ended("s", A, 1_000, True)
    assert planned[0].payload["target"] == {"session": "s"}


def test_observed_gaps_drive_the_estimate() -> None:
    table = SessionHintTable(PinOrDemote(estimator=GapEstimator(prior_ms=60_000, weight=0.5)))
    table.turn_started("s", A, 0)
    for start in (10_000, 30_000, 50_000):  # tool gaps of 2 s, 4 s, 6 s
        end = start - {10_000: 2_000, 30_000: 4_000, 50_000: 6_000}[start]
        table.turn_ended("s", A, end, tool_call=True)
        table.turn_started("s", A, start)
    entry = table.get("s")
    assert entry is not None
    assert entry.gaps_ms == [2_000, 4_000, 6_000]
    assert GapEstimator(weight=0.5).estimate(entry) == 4_500  # 2000 -> 3000 -> 4500
    assert kinds(table.turn_ended("s", A, 60_000, True)) == [(A, "kv.pin", 6_750 + 2_000)]


def test_long_gaps_and_refused_pins_demote_instead() -> None:
    table = SessionHintTable(PinOrDemote(max_pin_ms=10_000))
    table.turn_started("s", A, 0)
    assert kinds(table.turn_ended("s", A, 0, True, expected_gap_ms=60_000)) == [
        (A, "kv.demote", None)
    ]
    entry = table.get("s")
    assert entry is not None
    pin = table.turn_ended("s", A, 0, True, expected_gap_ms=1_000)[0]
    assert pin.action_type == "kv.pin"
    # a pin clipped by the TTL limit is still a pin; one the pin limits cut is not (the code
    # says which, whatever the words of the reason)
    table.outcome(entry, pin, {"outcome": "clipped", "code": "over-limits", "reason": "limit"})
    assert not entry.pin_refused
    table.outcome(entry, pin, {"outcome": "clipped", "code": "pin-limit", "reason": "..."})
    assert entry.pin_refused
    table.outcome(entry, pin, {"outcome": "rejected", "code": "pin-limit"})
    assert entry.pin_refused
    assert kinds(table.turn_ended("s", A, 0, True, expected_gap_ms=1_000)) == [
        (A, "kv.demote", None)
    ]
    assert entry.outcomes == {"kv.pin:clipped": 2, "kv.pin:rejected": 1}


def test_user_turns_retain_session_end_demotes_and_a_move_shares() -> None:
    table = SessionHintTable(PinOrDemote(estimator=GapEstimator(prior_ms=5_000)))
    table.turn_started("s", A, 0)
    [retain] = table.turn_ended("s", A, 0, tool_call=False)
    assert retain.action_type == "kv.retain"
    assert retain.payload["ttl_ms"] == 2 * (7_500 + 2_000)
    assert table.turn_started("s", B, 1_000) == [
        PlannedHint(A, "kv.share", {"target": {"session": "s"}, "destination": B})
    ]
    entry, planned = table.ended("s")
    assert entry is not None
    assert kinds(planned) == [(B, "kv.demote", None)]
    assert table.get("s") is None
    assert table.ended("s") == (None, [])


def test_the_table_is_bounded() -> None:
    table = SessionHintTable(PinOrDemote(), limit=3)
    for n in range(5):
        table.turn_started(f"s{n}", A, n)
    assert [table.get(f"s{n}") is None for n in range(5)] == [True, True, False, False, False]
