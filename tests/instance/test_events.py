"""The event log: consecutive numbers, replay after a sequence number, gaps reported."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.core.clock import ManualClock
from kvsp.instance.events import EventLog


def test_replay_after_a_sequence_number() -> None:
    log = EventLog(ManualClock(), capacity=8)
    for n in range(5):
        log.append("residency", block=f"k{n}", tiers=["g1"])
    page = log.after(2)
    assert [e["seq"] for e in page.events] == [3, 4, 5]
    assert page.events[0] == {"seq": 3, "kind": "residency", "at_ms": 0, "block": "k2",
                              "tiers": ["g1"]}  # fmt: skip
    assert page.last == 5
    assert not page.missed
    assert log.after(5).events == []
    assert [e["seq"] for e in log.after(0, limit=2).events] == [1, 2]


def test_a_consumer_that_fell_behind_the_buffer_is_told() -> None:
    log = EventLog(ManualClock(), capacity=3)
    for _ in range(10):
        log.append("eviction", block="k")
    page = log.after(4)
    assert page.missed  # 5..7 are gone
    assert [e["seq"] for e in page.events] == [8, 9, 10]
    assert not log.after(7).missed
    with pytest.raises(ValueError, match="after must be"):
        log.after(-1)


@given(st.integers(1, 20), st.integers(0, 50), st.integers(0, 60))
def test_no_silent_gaps(capacity: int, count: int, seq: int) -> None:
    """Whatever was asked: either the events follow ``seq`` without a gap, or ``missed``."""
    log = EventLog(ManualClock(), capacity)
    for _ in range(count):
        log.append("hint")
    page = log.after(min(seq, count))
    numbers = [e["seq"] for e in page.events]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))) if numbers else True
    if numbers and not page.missed:
        assert numbers[0] == min(seq, count) + 1
    if page.missed:
        assert numbers[0] > min(seq, count) + 1
