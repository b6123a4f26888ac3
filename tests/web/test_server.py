"""Bare ASGI endpoints (``AsgiEndpoint``, the hottest routes) under Starlette's router: their
errors become problem documents through the same handlers as every route's, each logged and
counted once, and their path parameters come as Starlette gives them."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvsp.core.problems import RecordError
from kvsp.web.server import AsgiEndpoint, install_problem_handlers, send_json

pytestmark = pytest.mark.anyio


async def fine(scope: Scope, receive: Receive, send: Send) -> None:
    await send_json(send, b'{"ok":true}')


async def refuses(scope: Scope, receive: Receive, send: Send) -> None:
    raise RecordError("no such thing")


async def breaks(scope: Scope, receive: Receive, send: Send) -> None:
    raise RuntimeError("a bug")


async def test_bare_endpoints_and_their_errors(caplog: pytest.LogCaptureFixture) -> None:
    endpoints = {path: AsgiEndpoint(h) for path, h in (("/ok", fine), ("/bad", refuses))}
    endpoints["/bug"] = AsgiEndpoint(breaks)
    app = Starlette(routes=[Route(p, e, methods=["POST"]) for p, e in endpoints.items()])
    rejected: list[str] = []
    install_problem_handlers(app, logging.getLogger("kvsp.test"), rejected.append)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        caplog.set_level(logging.INFO, "kvsp.test")
        assert (await client.post("/ok")).json() == {"ok": True}
        bad = await client.post("/bad")
        assert bad.status_code == 400
        assert bad.headers["content-type"] == "application/problem+json"
        assert bad.json()["detail"] == "no such thing"
        assert bad.json()["instance"] == "/bad"
        bug = await client.post("/bug")
        assert bug.status_code == 500
        assert "a bug" not in bug.text
        assert (await client.get("/ok")).status_code == 405
        assert (await client.post("/nothing")).status_code == 404
    assert rejected == [
        "kvsp-invalid-record",
        "kvsp-internal",
        "kvsp-method-not-allowed",
        "kvsp-not-found",
    ]
    failures = [r for r in caplog.records if r.name == "kvsp.test"]
    assert len(failures) == 4
    assert failures[1].exc_info is not None


async def test_bare_endpoints_with_parameters() -> None:
    async def echo(scope: Scope, receive: Receive, send: Send) -> None:
        await send_json(send, json.dumps(scope["path_params"]).encode())

    path = "/v/items/{kind}/{item_id}"
    app = Starlette(routes=[Route(path, AsgiEndpoint(echo), methods=["GET"])])
    install_problem_handlers(app, logging.getLogger("kvsp.test"), lambda _: None)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        assert (await client.get("/v/items/a/7")).json() == {"kind": "a", "item_id": "7"}
        for other in ("/v/items/a", "/v/items/a/7/x", "/v/items//7", "/v/other/a/7"):
            assert (await client.get(other)).status_code == 404
        assert (await client.put("/v/items/a/7")).status_code == 405
