"""Sending the policy's hints: an instance that cannot be reached defers the action (never
"done"), the outcome is counted and fed back to the policy's state for the session."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter

from kvsp.controller.client import InstanceClient
from kvsp.controller.hint_sender import HintSender
from kvsp.controller.hints import PinOrDemote, PlannedHint, SessionHintTable
from kvsp.core.hints import ActionType, Reason
from tests.servers import free_port

pytestmark = pytest.mark.anyio


async def test_an_unreachable_instance_defers_a_pin_and_the_policy_hears_of_it() -> None:
    table = SessionHintTable(PinOrDemote())
    gone = f"http://127.0.0.1:{free_port()}/kvsp/"
    table.turn_started("s1", gone, 0)
    outcomes = Counter("o", "o", ["action", "outcome"], registry=CollectorRegistry())
    peers = InstanceClient(None)
    try:
        sender = HintSender(peers, table, outcomes)
        pin = PlannedHint(gone, ActionType.PIN, {"session_id": "s1", "ttl_ms": 1_000})
        [answer] = await sender.send("s1", [pin])
    finally:
        await peers.aclose()
    assert answer["instance"] == gone
    assert answer["outcome"] == "deferred"
    assert answer["code"] == Reason.UNREACHABLE
    assert outcomes.labels(ActionType.PIN, "deferred")._value.get() == 1
    entry = table.get("s1")
    assert entry is not None
    assert not entry.pin_refused  # deferred is not refused: the policy tries a pin again
