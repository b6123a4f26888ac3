"""``HotRoutes``: a service's bare endpoints on fixed paths answered before Starlette's stack,
with the same roles, the same problem documents (each logged and counted once) and everything
else left to the app."""

from __future__ import annotations

import logging

import httpx
import pytest
from starlette.applications import Starlette
from starlette.types import ASGIApp, Receive, Scope, Send

from kvsp.auth import Principals, Role, token_sha256
from kvsp.core.problems import RecordError
from kvsp.web.openapi import ANYONE, HotRoutes, Op, routes_of
from kvsp.web.server import AsgiEndpoint, install_problem_handlers, send_json

pytestmark = pytest.mark.anyio

PRINCIPALS = f"""
[principals.c]
token_sha256 = "{token_sha256("c")}"
roles = ["client"]
"""


async def fine(scope: Scope, receive: Receive, send: Send) -> None:
    await send_json(send, b'{"ok":true}')


async def refuses(scope: Scope, receive: Receive, send: Send) -> None:
    raise RecordError("no such thing")


async def breaks(scope: Scope, receive: Receive, send: Send) -> None:
    raise RuntimeError("a bug")


class Counting:
    """Middleware that counts the requests that reach Starlette's stack."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.seen: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.seen.append(scope["path"])
        await self.app(scope, receive, send)


async def test_hot_routes_answer_as_the_app_would(caplog: pytest.LogCaptureFixture) -> None:
    ops = [
        Op("POST", "ok", AsgiEndpoint(fine), "fine", ANYONE),
        Op("POST", "bad", AsgiEndpoint(refuses), "refuses", ANYONE),
        Op("POST", "bug", AsgiEndpoint(breaks), "breaks", ANYONE),
        Op("POST", "guarded", AsgiEndpoint(fine), "for clients", (Role.CLIENT,)),
        Op("POST", "items/{item}", AsgiEndpoint(fine), "has a parameter", ANYONE),
    ]
    app = Starlette(routes=routes_of("/v/", "test", ops, Principals.parse(PRINCIPALS)))
    rejected: list[str] = []
    responder = install_problem_handlers(app, logging.getLogger("kvsp.test"), rejected.append)
    counting = Counting(app.middleware_stack or app.build_middleware_stack())
    app.middleware_stack = counting  # type: ignore[assignment]
    hot = HotRoutes(app, responder)
    transport = httpx.ASGITransport(app=hot, raise_app_exceptions=False)
    caplog.set_level(logging.INFO, "kvsp.test")
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        assert (await client.post("/v/ok")).json() == {"ok": True}
        bad = await client.post("/v/bad")
        assert bad.status_code == 400
        assert bad.headers["content-type"] == "application/problem+json"
        assert (bad.json()["detail"], bad.json()["instance"]) == ("no such thing", "/v/bad")
        bug = await client.post("/v/bug")
        assert bug.status_code == 500
        assert "a bug" not in bug.text
        assert (await client.post("/v/guarded")).status_code == 401
        token = {"authorization": "Bearer c"}
        assert (await client.post("/v/guarded", headers=token)).json() == {"ok": True}
        assert (await client.post("/v/items/7")).json() == {"ok": True}
        assert (await client.get("/v/ok")).status_code == 405
    # only the route with a parameter and the wrong method went through Starlette
    assert counting.seen == ["/v/items/7", "/v/ok"]
    assert rejected == [
        "kvsp-invalid-record",
        "kvsp-internal",
        "kvsp-unauthenticated",
        "kvsp-method-not-allowed",
    ]
    logged = [r for r in caplog.records if r.name == "kvsp.test"]
    assert len(logged) == 4
    assert logged[1].exc_info is not None
