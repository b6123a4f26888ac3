"""The front end's routes: ``v1/completions``, ``v1/chat/completions`` and ``v1/models``,
added to the controller's app by whoever serves them together (``kvsp controller serve
--frontend``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kvsp.core.problems import InvalidInput
from kvsp.frontend.service import CompletionRequest, FrontEnd
from kvsp.web.openapi import ANYONE, Op
from kvsp.web.server import header_value, read_json_body

__all__ = ["frontend_ops"]

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
