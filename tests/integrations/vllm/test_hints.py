"""The envelopes a request carries into the connector (vLLM's own, Dynamo's bridge field) and
how each action is resolved before it runs: session targets to the blocks served for the
session in the request's tenant, block keys only in the tenant's scopes, unknown actions and
bad payloads refused by name."""

from __future__ import annotations

from typing import Any

from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope

from kvsp.core.hints import HintOutcome, KvHints
from kvsp.holder.client import HolderClient
from kvsp.index.client import IndexClient
from kvsp.integrations.vllm.g1 import G1Pages
from kvsp.integrations.vllm.hints import ConnectorHints, Planned, request_hints
from kvsp.tenants import Tenant
from tests.index.factories import COMPAT, key

ACME = Tenant("acme", b"a" * 32, "a1" * 16, frozenset({COMPAT}))
OTHER = Tenant("other", b"o" * 32, "b2" * 16, frozenset({COMPAT}))


def doc(*actions: tuple[str, str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "protocol_version": "0.1",
        "message_id": "m1",
        "actions": [
            {"action_id": f"a{i}", "action_type": t, "action_version": v, "payload": p}
            for i, (t, v, p) in enumerate(actions)
        ],
    }


def test_vllm_s_envelope_and_dynamo_s_bridge_field_read_alike() -> None:
    body = doc(("kv.pin", "1.0", {"target": {"session": "s"}, "ttl_ms": 5}))
    native = KvHintsEnvelope("0.1", "m1", [KvHintAction(**body["actions"][0])])
    from_vllm, _ = request_hints(native, None)
    from_dynamo, _ = request_hints(None, {"kv_hint": body})
    assert from_vllm == from_dynamo == KvHints.model_validate(body)
    assert request_hints(None, {"kvsp": {"tenant": "acme"}}) == (None, None)
    refused, why = request_hints(None, {"kv_hint": {**body, "protocol_version": "9"}})
    assert refused is None
    assert why is not None


def test_targets_resolve_in_the_request_s_tenant_only() -> None:
    pages = G1Pages(16)
    hints = ConnectorHints(COMPAT, None, pages, IndexClient("http://127.0.0.1:1/kvsp/"),
                           HolderClient(None))  # fmt: skip
    served = [(COMPAT, ACME.scope_id, key(n)) for n in (1, 2)]
    hints.served(ACME, "s", served)
    pages.stored([7])
    pages.record(7, served[:1])
    plan = hints.plan(
        ACME,
        KvHints.model_validate(
            doc(
                ("kv.pin", "1.0", {"target": {"session": "s"}, "ttl_ms": 5}),
                (
                    "kv.demote",
                    "1.0",
                    {"target": {"scope_id": OTHER.scope_id, "block_keys": [key(1)]}},
                ),
                ("kv.fetch", "1.0", {"block_hashes": [1]}),
                ("kv.retain", "1.0", {"target": {"session": "s"}, "colour": "red"}),
                (
                    "kv.prefetch",
                    "1.1",
                    {"target": {"scope_id": ACME.scope_id, "block_keys": [key(2)]}},
                ),
            )
        ),
    )
    pin, foreign, fetch, bad, prefetch = plan
    assert isinstance(pin, Planned)
    assert (pin.blocks, pin.in_g1) == (tuple(served), frozenset(served[:1]))
    assert isinstance(foreign, HintOutcome)
    assert (foreign.outcome, foreign.code) == ("rejected", "forbidden")
    assert isinstance(fetch, HintOutcome)
    assert fetch.code == "not-implemented"
    assert "kv.fetch version 1.0" in (fetch.reason or "")
    assert isinstance(bad, HintOutcome)
    assert bad.code == "invalid"
    assert isinstance(prefetch, Planned)
    assert prefetch.blocks == (served[1],)
    # another tenant's request naming the same session finds nothing of it
    pin_s = doc(("kv.pin", "1.0", {"target": {"session": "s"}, "ttl_ms": 5}))
    (theirs,) = hints.plan(OTHER, KvHints.model_validate(pin_s))
    assert isinstance(theirs, Planned)
    assert theirs.blocks == ()
