"""Nothing a client sends crashes the Index Service: arbitrary bodies get problem documents."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp.auth import Principals
from kvsp.core.clock import ManualClock
from kvsp.index.app import create_app
from kvsp.index.rules import IndexLimits
from kvsp.index.service import IndexService
from kvsp.index.stores import MemoryReplicaStore
from tests.index.factories import COMPAT, SCOPE_A, key, replica

HEX_KEY = key(0)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=70),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=6)
    ),
    max_leaves=20,
)
GOOD = replica(0).to_json()


def mutated_record() -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(
        lambda field, value: {**GOOD, field: value},
        st.sampled_from(sorted(GOOD)),
        json_values,
    )


ROUTES = [
    ("PUT", f"replicas/{COMPAT}/{SCOPE_A}/{HEX_KEY}"),
    ("POST", "replicas"),
    ("POST", "lookup"),
    ("PUT", "status"),
    ("DELETE", f"replicas/{COMPAT}/{SCOPE_A}/{HEX_KEY}?holder=http://h/kvsp/"),
]


def _service() -> IndexService:
    return IndexService(MemoryReplicaStore(ManualClock(), IndexLimits(max_records=100)))


async def _send(service: IndexService, method: str, path: str, body: bytes) -> httpx.Response:
    app = create_app(service, Principals.development_mode(), max_body_octets=1 << 16)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://index.test/kvsp/"
    ) as client:
        return await client.request(
            method, path, content=body, headers={"content-type": "application/kvsp+json"}
        )


@settings(max_examples=150)
@given(
    st.sampled_from(ROUTES),
    st.one_of(
        json_values.map(lambda v: json.dumps(v).encode()),
        mutated_record().map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=300),
    ),
)
def test_no_body_makes_a_server_error(route: tuple[str, str], body: bytes) -> None:
    service = _service()
    response = asyncio.run(_send(service, *route, body))
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["status"] == response.status_code
