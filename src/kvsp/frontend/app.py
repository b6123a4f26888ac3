"""The front end's routes: ``v1/completions``, ``v1/chat/completions`` and ``v1/models``,
added to the controller's app by whoever serves them together (``kvsp controller serve
--frontend``), or served on their own before several controllers (``create_app``: ``kvsp
frontend serve``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kvsp.auth import Principals
from kvsp.core.problems import InvalidInput
from kvsp.frontend.controllers import RemoteController
from kvsp.frontend.service import CompletionRequest, FrontEnd, log
from kvsp.web.openapi import ANYONE, HEALTH, Op, routes_of
from kvsp.web.probes import metrics_op, probe_ops
from kvsp.web.server import (
    header_value,
    install_problem_handlers,
    json_response,
    lifespan_of,
    read_json_body,
)

__all__ = ["create_app", "frontend_ops"]

T = TypeVar("T")


async def _unless_gone(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result, or ``work`` cancelled when the client goes away first (its body
    is read: the next ASGI message can only be the disconnect)."""
    task = asyncio.create_task(work)
    gone: asyncio.Future[Any] = asyncio.ensure_future(request.receive())
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise InvalidInput("the client went away before its answer")
    return task.result()


def frontend_ops(frontend: FrontEnd, body_octets: int) -> list[Op]:
    """``v1/completions``, ``v1/chat/completions`` and ``v1/models``."""

    def handler(chat: bool) -> Any:
        async def complete(request: Request) -> Response:
            tenant = frontend.tenant(header_value(request.scope, b"authorization"))
            raw = await read_json_body(request, body_octets)
            header = header_value(request.scope, b"x-session-id")
            parsed = frontend.parse(raw, chat, header)
            if parsed.stream:
                events = await frontend.events(tenant, parsed, chat)
                return StreamingResponse(events, media_type="text/event-stream")
            answer = await _unless_gone(request, frontend.answer(tenant, parsed, chat))
            return Response(json.dumps(answer).encode(), media_type="application/json")

        return complete

    async def models(_: Request) -> Response:
        doc = {"object": "list", "data": [{"id": frontend.model, "object": "model",
                                           "owned_by": "kvsp"}]}  # fmt: skip
        return Response(json.dumps(doc).encode(), media_type="application/json")

    answer = {"type": "object"}
    own = "the API key's tenant"
    return [
        Op("POST", "v1/completions", handler(False), "an OpenAI completion", ANYONE, own,
           CompletionRequest, {200: answer}, api_key=True),
        Op("POST", "v1/chat/completions", handler(True), "an OpenAI chat completion", ANYONE,
           own, CompletionRequest, {200: answer}, api_key=True),
        Op("GET", "v1/models", models, "the model served", ANYONE, answers={200: answer}),
    ]  # fmt: skip


def create_app(
    frontend: FrontEnd, controllers: RemoteController, principals: Principals
) -> Starlette:
    """The front end on its own: its routes, probes (ready when a controller is), health and
    metrics (``principals`` say who may read them; completions take tenants' API keys)."""
    from kvsp.controller.app import BODY_OCTETS

    async def healthz(_: Request) -> Response:
        return json_response(b'{"status":"ok"}')

    async def started() -> None:
        return None

    ops = [
        *frontend_ops(frontend, BODY_OCTETS),
        *probe_ops("frontend", controllers.first_ready),
        Op("GET", "healthz", healthz, "liveness", ANYONE, answers={200: HEALTH}),
        metrics_op(frontend.metrics.registry),
    ]  # fmt: skip
    app = Starlette(
        routes=routes_of("/kvsp/", "kvsp front end", ops, principals),
        lifespan=lifespan_of(started, frontend.aclose),
    )
    install_problem_handlers(app, log, lambda _: None)
    return app
