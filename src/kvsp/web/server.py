"""Server-side HTTP plumbing every kvsp service shares (Starlette).

- Errors: every ``KvspError`` becomes its RFC 9457 document with its status; routing errors
  (404/405) become problem documents too; anything unexpected is logged with its traceback
  and answered 500, never swallowed. Each rejected request is logged once and counted by type.
- Bodies: only ``application/kvsp+json`` (or ``application/json``) is accepted (415 otherwise)
  and bodies above a limit are refused (413) before they are read whole.
- Authentication: the bearer token is resolved once per request with ``kvsp.auth``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvsp.core.problems import (
    InvalidInput,
    KvspError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RecordError,
    ServiceUnavailable,
    UnsupportedMediaType,
)
from kvsp.core.registries import JSON_MEDIA_TYPE, PROBLEM_MEDIA_TYPE

__all__ = [
    "AsgiEndpoint",
    "InflightOctets",
    "ProblemResponder",
    "header_value",
    "install_problem_handlers",
    "json_response",
    "lifespan_of",
    "parse_json_object",
    "read_body",
    "read_json_body",
    "send_json",
]

_ACCEPTED_TYPES = (JSON_MEDIA_TYPE, "application/json")
#: a path segment that is a parameter, as Starlette writes it
_PARAMETER = re.compile(r"\{[A-Za-z_][A-Za-z0-9_]*\}")


def json_response(body: bytes, status: int = 200) -> Response:
    """A response whose JSON body is already serialised (records are served as stored)."""
    return Response(content=body, status_code=status, media_type=JSON_MEDIA_TYPE)


def _problem(error: KvspError, request: Request) -> JSONResponse:
    retry = error.extensions.get("retry_after_s")
    return JSONResponse(
        error.to_problem(instance=request.url.path),
        status_code=error.status,
        media_type=PROBLEM_MEDIA_TYPE,
        headers=None if retry is None else {"retry-after": str(retry)},
    )


class ProblemResponder:
    """Turns every error into a problem document: logs it once, reports its type to
    ``on_reject``. Installed as a Starlette app's exception handlers."""

    def __init__(self, log: logging.Logger, on_reject: Callable[[str], None]) -> None:
        self._log = log
        self._on_reject = on_reject

    async def kvsp_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, KvspError)
        self._on_reject(exc.slug)
        level = logging.WARNING if exc.status >= 500 else logging.INFO
        self._log.log(
            level,
            "%s %s -> %d %s: %s",
            request.method,
            request.url.path,
            exc.status,
            exc.slug,
            exc.detail,
        )
        return _problem(exc, request)

    async def http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        error: KvspError
        if exc.status_code == 404:
            error = NotFound(f"no route {request.url.path}")
        elif exc.status_code == 405:
            error = MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}")
        else:
            error = InvalidInput(str(exc.detail))
        return await self.kvsp_error(request, error)

    async def unexpected(self, request: Request, exc: Exception) -> Response:
        self._log.exception("%s %s failed", request.method, request.url.path)
        self._on_reject(KvspError.slug)
        return _problem(KvspError("internal error; the server log has the details"), request)


def install_problem_handlers(
    app: Starlette, log: logging.Logger, on_reject: Callable[[str], None]
) -> ProblemResponder:
    """Map every error to a problem document; log each once; report its type to ``on_reject``."""
    responder = ProblemResponder(log, on_reject)
    app.add_exception_handler(KvspError, responder.kvsp_error)
    app.add_exception_handler(StarletteHTTPException, responder.http_error)
    app.add_exception_handler(Exception, responder.unexpected)
    return responder


def lifespan_of(
    start: Callable[[], Awaitable[None]], close: Callable[[], Awaitable[None]]
) -> Callable[[Starlette], AbstractAsyncContextManager[None]]:
    """A Starlette lifespan that starts a service's background work and closes it at exit."""

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await start()
        try:
            yield
        finally:
            await close()

    return lifespan


class AsgiEndpoint:
    """Marks a coroutine as a bare ASGI endpoint for Starlette's router (which would otherwise
    wrap a function in request and response objects): for the hottest routes."""

    def __init__(self, handler: ASGIApp) -> None:
        self._handler = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._handler(scope, receive, send)


class InflightOctets:
    """Bounds the octets of request bodies being received at once: one client's many large
    PUTs can pin at most ``limit`` octets of memory; past it a request is refused at once with
    503 and ``Retry-After`` (it may come back when others are done)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    @contextmanager
    def reserve(self, octets: int) -> Iterator[None]:
        if self.held + octets > self.limit:
            raise ServiceUnavailable(
                f"{self.held} octets of bodies are being received; {octets} more would pass "
                f"the {self.limit}-octet limit",
                retry_after_s=1,
            )
        self.held += octets
        try:
            yield
        finally:
            self.held -= octets


def header_value(scope: Scope, name: bytes) -> str | None:
    """A request header from an ASGI scope (``name`` in lowercase)."""
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


async def read_body(
    scope: Scope,
    receive: Receive,
    max_octets: int,
    media_types: tuple[str, ...] = _ACCEPTED_TYPES,
    inspect: Callable[[bytes], bool] | None = None,
) -> bytes:
    """The request body, if it is of an accepted type (JSON unless told otherwise) and at most
    ``max_octets``. ``inspect`` sees the octets received so far as they come, until it says it
    has seen enough (True) or raises to refuse the body before the rest is read.

    Works on the ASGI primitives so that the hottest routes can skip request objects.
    """
    content_type = declared = None
    for key, value in scope["headers"]:  # one pass; the first of a repeated header counts
        if key == b"content-type" and content_type is None:
            content_type = value
        elif key == b"content-length" and declared is None:
            declared = value
    media_type = (content_type or b"").partition(b";")[0].strip().lower().decode("latin-1")
    if media_type not in media_types:
        raise UnsupportedMediaType(
            f"content type {media_type or '(none)'!r} is not {media_types[0]}"
        )
    if declared is not None and declared.isdigit() and int(declared) > max_octets:
        raise PayloadTooLarge(
            f"body of {declared.decode()} octets is above the {max_octets}-octet limit"
        )
    chunks: list[bytes] = []
    received = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise InvalidInput("the client went away before sending its body")
        chunk: bytes = message.get("body", b"")
        received += len(chunk)
        if received > max_octets:
            raise PayloadTooLarge(f"body is above the {max_octets}-octet limit")
        more = message.get("more_body", False)
        if inspect is not None and (
            inspect(b"".join([*chunks, chunk]) if chunks else chunk) or not more
        ):
            inspect = None
        if not more:
            return b"".join([*chunks, chunk]) if chunks else chunk
        chunks.append(chunk)


async def read_json_body(request: Request, max_octets: int) -> bytes:
    """``read_body`` for a Starlette request."""
    return await read_body(request.scope, request.receive, max_octets)


_JSON_CONTENT_TYPE = (b"content-type", JSON_MEDIA_TYPE.encode())


async def send_json(send: Send, body: bytes, status: int = 200) -> None:
    """Answer with an already serialised JSON body, straight on the ASGI channel."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [_JSON_CONTENT_TYPE, (b"content-length", b"%d" % len(body))],
        }
    )
    await send({"type": "http.response.body", "body": body})


def parse_json_object(body: bytes) -> dict[str, Any]:
    """A JSON object from a body; anything else (nested too deep included) is a 400
    ``RecordError``."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecordError(f"body is not JSON: {exc}") from None
    except RecursionError:
        raise RecordError("body is nested too deeply") from None
    if not isinstance(doc, dict):
        raise RecordError("body must be a JSON object")
    return doc
