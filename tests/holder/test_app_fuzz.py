"""Nothing a client sends crashes a holder: damaged containers, odd queries and arbitrary lease
bodies get problem documents, and nothing damaged is ever stored."""

from __future__ import annotations

import asyncio
import json

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp.auth import Principals
from kvsp.holder.app import create_app
from kvsp.holder.service import HolderConfig, HolderService
from tests.holder.factories import COMPAT, SCOPE, block_id, container, stored

GOOD = container(1).tobytes()
KEY = block_id(1)[2]


async def _send(
    service: HolderService, method: str, path: str, body: bytes, ctype: str
) -> httpx.Response:
    app = create_app(service, Principals.development_mode())
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://holder.test/kvsp/"
    ) as client:
        return await client.request(
            method, path, content=body, headers={"content-type": ctype, "if-none-match": "*"}
        )


def _check(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert response.headers["content-type"] == "application/problem+json"
        assert response.json()["status"] == response.status_code


damaged = st.one_of(
    st.binary(max_size=200),
    st.tuples(st.integers(0, len(GOOD) - 1), st.integers(1, 255)).map(
        lambda p: GOOD[: p[0]] + bytes([GOOD[p[0]] ^ p[1]]) + GOOD[p[0] + 1 :]
    ),
    st.integers(0, len(GOOD) - 1).map(lambda n: GOOD[:n]),
    st.binary(min_size=1, max_size=8).map(lambda extra: GOOD + extra),
)


@settings(max_examples=150)
@given(damaged)
def test_damaged_containers_are_refused_or_stored_verbatim(body: bytes) -> None:
    service = HolderService(HolderConfig(url="http://holder.test/kvsp/", host_bytes=1 << 20))
    try:
        response = asyncio.run(
            _send(service, "PUT", f"blocks/{COMPAT}/{SCOPE}/{KEY}", body, "application/kvsp-block")
        )
        _check(response)
        if response.status_code == 201:  # a flip in a section is a different, valid block
            read = service.store.get(block_id(1))
            assert read.header.encode() + b"".join(read.parts) == body
        else:
            assert block_id(1) not in service.store
    finally:
        service._worker.shutdown()


@settings(max_examples=100)
@given(
    st.one_of(
        st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=40).map(
            lambda q: ("GET", f"blocks/{COMPAT}/{SCOPE}/{KEY}?{q}", b"")
        ),
        st.binary(max_size=200).map(lambda b: ("POST", "leases", b)),
        st.dictionaries(
            st.sampled_from(["compat_id", "scope_id", "block_keys", "ttl_ms"]),
            st.one_of(
                st.integers(), st.text(max_size=70), st.lists(st.text(max_size=70), max_size=3)
            ),
        ).map(lambda d: ("POST", "leases", json.dumps(d).encode())),
        st.binary(max_size=100).map(lambda b: ("PUT", "leases/x", b)),
    )
)
def test_no_request_makes_a_server_error(request: tuple[str, str, bytes]) -> None:
    service = HolderService(HolderConfig(url="http://holder.test/kvsp/", host_bytes=1 << 20))
    try:
        service.store.put(block_id(1), *stored(1)[:2])
        method, path, body = request
        _check(asyncio.run(_send(service, method, path, body, "application/json")))
    finally:
        service._worker.shutdown()
