"""Session-aware KV on real instances: sessions resolved through the SessionPrefixIndex, each
KvHint action carried out and observable (outcomes, events, Replica Records), Share making a
session's KV available on another instance without recomputation, and pins bounded."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.instances import (
    PROMPT,
    Cluster,
    active,
    eventually,
    generate,
    residency,
)
from tests.servers import running

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


def envelope(*actions: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "protocol_version": "0.1",
        "message_id": str(uuid.uuid4()),
        "actions": [
            {"action_id": f"a{i}", "action_type": kind, "action_version": "1.0",
             "payload": payload}
            for i, (kind, payload) in enumerate(actions)
        ],
    }  # fmt: skip


async def hint(base: str, *actions: tuple[str, dict[str, Any]]) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(base + "hints", json=envelope(*actions))
        assert response.status_code == 200, response.text
        outcomes: list[dict[str, Any]] = response.json()["outcomes"]
        return outcomes


async def events(base: str, after: int = 0) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=60) as http:
        answer: dict[str, Any] = (await http.get(f"{base}events?after={after}")).json()
        return answer


async def test_hints_on_a_session_demote_prefetch_pin_share_and_report(
    tmp_path: Path, reference: list[int], compat: str
) -> None:
    cluster = Cluster(tmp_path, compat)
    a = cluster.instance("--session-index", "--g1-blocks", "8", "--g2-bytes", "9M")
    b = cluster.instance()
    session = str(uuid.uuid4())
    me = {"target": {"session": session}}
    with running(cluster.index, cluster.holder, a, b):
        first = await generate(a.base_url, PROMPT, 24, session=session)
        assert first["tokens"] == reference
        where = lambda: residency(cluster.index.base_url, compat, PROMPT, a.base_url)  # noqa: E731
        await eventually(where, [["device", [0, 29]]])

        # Demote: a G2 copy, G1 freed; the IS record says host
        [out] = await hint(a.base_url, ("kv.demote", me))
        assert (out["outcome"], out["blocks"]) == ("accepted", 4)  # 74 tokens: 4 blocks
        await eventually(where, [["host", [0, 29]]])
        # Prefetch: back into G1
        [out] = await hint(a.base_url, ("kv.prefetch", me))
        assert (out["outcome"], out["blocks"]) == ("accepted", 4)
        await eventually(where, [["device", [0, 29]]])

        # Pin in G2 with a TTL above the limit: clipped, then memory pressure leaves it alone
        [out] = await hint(a.base_url, ("kv.pin", {**me, "ttl_ms": 10**9, "tier": "g2"}))
        assert out["outcome"] == "clipped"
        assert out["ttl_ms"] == 300_000
        for n in range(5):  # other prompts: 20 more blocks through G1 (8) and G2 (12)
            await generate(a.base_url, [PROMPT[0] + 1 + n, *PROMPT[1:]], 24)
        again = await generate(a.base_url, PROMPT, 24)
        assert again["tokens"] == reference
        assert again["summary"]["cached"] == {"g2": 48}  # kept in G2 by the pin

        # Share with B: B holds and publishes the blocks, and reuses them without recomputing
        [out] = await hint(a.base_url, ("kv.share", {**me, "destination": b.base_url}))
        assert (out["outcome"], out["blocks"]) == ("accepted", 4)
        on_b = await generate(b.base_url, PROMPT, 24)
        assert on_b["tokens"] == reference
        assert on_b["summary"]["cached"] == {"g1": 48}  # local at B: no fetch, no recompute

        # what cannot be done is an outcome, never an error for the envelope
        outcomes = await hint(
            a.base_url,
            ("kv.fetch", me),
            ("kv.pin", {"target": {"session": session}}),
            ("kv.retain", {"target": {"session": str(uuid.uuid4())}}),
            ("kv.retain", {**me, "ttl_ms": 1_000, "priority": 7, "limit_blocks": 2}),
        )
        assert [o["outcome"] for o in outcomes] == ["rejected", "rejected", "missing", "clipped"]
        assert outcomes[3]["blocks"] == 2
        [out] = await hint(b.base_url, ("kv.demote", me))
        assert out["outcome"] == "rejected"  # B keeps no session index
        assert "session index" in out["reason"]

        # hints riding on a request run when it is done
        pin = envelope(("kv.pin", {**me, "ttl_ms": 2_000}))
        ridden = await generate(a.base_url, PROMPT, 8, session=session, kv_hints=pin)
        assert ridden["summary"]["kv_hints"][0]["outcome"] == "accepted"

        # the session ends: its pins go
        async with httpx.AsyncClient() as http:
            ended = (await http.delete(f"{a.base_url}sessions/{session}")).json()
        assert ended["pins_released"] >= 4

        # every step above is in the event log, numbered without gaps
        log = await events(a.base_url)
        assert not log["missed"]
        seqs = [e["seq"] for e in log["events"]]
        assert seqs == list(range(1, len(seqs) + 1))
        kinds = {e["kind"] for e in log["events"]}
        assert {"association", "residency", "eviction", "transfer", "hint"} <= kinds
        later = await events(a.base_url, after=seqs[-1])
        assert later["events"] == []
        assert later["last"] == seqs[-1]
    for service in (a, b):
        assert service.log.count(b"Traceback") == 0


async def test_the_controller_pins_for_a_tool_gap_shares_on_a_move_and_demotes_at_the_end(
    tmp_path: Path, reference: list[int], compat: str
) -> None:
    cluster = Cluster(tmp_path, compat, controller=True)
    pc = cluster.pc
    a, b = cluster.instance("--session-index"), cluster.instance("--session-index")
    name = "a-conversation"  # any name: the controller namespaces it by tenant
    with running(cluster.index, cluster.holder, cluster.controller, a, b):
        async with httpx.AsyncClient(timeout=120) as http:
            await eventually(lambda: active(pc), {a.base_url, b.base_url})
            place = {"tenant": "acme", "compat_id": compat, "tokens": PROMPT, "session": name}
            placed = (await http.post(pc + "place", json=place)).json()
            session = placed["session"]  # the UUID the controller keeps it under
            assert session != name
            first, other = (a, b) if placed["instance"] == a.base_url else (b, a)
            turn = await generate(first.base_url, PROMPT, 24, session=session)
            assert turn["tokens"] == reference

            # the turn ends in a tool call: the instance pins the session's KV for the gap
            gap = {"tool_call": True, "expected_gap_ms": 3_000}
            answer = (await http.post(f"{pc}sessions/{session}/turns", json=gap)).json()
            [pin] = answer["outcomes"]
            assert (pin["instance"], pin["action_type"]) == (first.base_url, "kv.pin")
            assert (pin["outcome"], pin["blocks"], pin["ttl_ms"]) == ("accepted", 4, 6_500)
            view = (await http.get(f"{pc}sessions/{session}")).json()
            assert view["hints"]["outcomes"] == {"kv.pin:accepted": 1}

            # the next turn goes to the other instance: the KV is shared there first
            change = {"instance": first.base_url, "state": "draining"}
            assert (await http.put(pc + "instances/state", json=change)).status_code == 200
            turn2 = PROMPT + turn["tokens"] + [13, 1073, 314]
            placed = (await http.post(pc + "place", json={**place, "tokens": turn2})).json()
            assert placed["instance"] == other.base_url
            for block in range(4):  # every block of the session's KV has been shared
                held = lambda b=block: residency(  # noqa: E731
                    cluster.index.base_url, compat, PROMPT + turn["tokens"], other.base_url, b
                )
                await eventually(held, [["device", [0, 29]]])
            second = await generate(other.base_url, turn2, 8, session=session)
            assert second["summary"]["cached"] == {"g1": 64}  # shared, then found locally

            # the session ends: its KV is demoted and the instance forgets the session
            answer = (await http.delete(f"{pc}sessions/{session}")).json()
            assert [(o["action_type"], o["outcome"]) for o in answer["outcomes"]] == [
                ("kv.demote", "accepted")
            ]
            assert (await http.get(f"{pc}sessions/{session}")).status_code == 404
            log = await events(other.base_url)
            assert {"session": session, "ended": True} in [
                {k: e[k] for k in ("session", "ended") if k in e} for e in log["events"]
            ]
            metrics = (await http.get(pc + "metrics")).text
            for action in ("kv.pin", "kv.share", "kv.demote"):
                assert (
                    f'kvsp_controller_hints_total{{action="{action}",outcome="accepted"}} 1.0'
                    in (metrics)
                )
    for service in (a, b, cluster.controller):
        assert service.log.count(b"Traceback") == 0
