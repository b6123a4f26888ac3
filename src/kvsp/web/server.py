"""Server-side HTTP plumbing every kvsp service shares (FastAPI/Starlette).

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
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvsp.auth import Principal, Principals
from kvsp.core.problems import (
    InvalidInput,
    KvspError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RecordError,
    UnsupportedMediaType,
)

__all__ = [
    "JSON_MEDIA_TYPE",
    "PROBLEM_MEDIA_TYPE",
    "install_problem_handlers",
    "json_response",
    "parse_json_object",
    "principal_of",
    "read_json_body",
]

JSON_MEDIA_TYPE = "application/kvsp+json"
PROBLEM_MEDIA_TYPE = "application/problem+json"
_ACCEPTED_TYPES = (JSON_MEDIA_TYPE, "application/json")


def json_response(body: bytes, status: int = 200) -> Response:
    """A response whose JSON body is already serialised (records are served as stored)."""
    return Response(content=body, status_code=status, media_type=JSON_MEDIA_TYPE)


def _problem(error: KvspError, request: Request) -> JSONResponse:
    return JSONResponse(
        error.to_problem(instance=request.url.path),
        status_code=error.status,
        media_type=PROBLEM_MEDIA_TYPE,
    )


def install_problem_handlers(
    app: FastAPI, log: logging.Logger, on_reject: Callable[[str], None]
) -> None:
    """Map every error to a problem document; log each once; report its type to ``on_reject``."""

    async def kvsp_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, KvspError)
        on_reject(exc.slug)
        level = logging.WARNING if exc.status >= 500 else logging.INFO
        log.log(
            level,
            "%s %s -> %d %s: %s",
            request.method,
            request.url.path,
            exc.status,
            exc.slug,
            exc.detail,
        )
        return _problem(exc, request)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        error: KvspError
        if exc.status_code == 404:
            error = NotFound(f"no route {request.url.path}")
        elif exc.status_code == 405:
            error = MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}")
        else:
            error = InvalidInput(str(exc.detail))
        return await kvsp_error(request, error)

    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("%s %s failed", request.method, request.url.path)
        on_reject(KvspError.slug)
        return _problem(KvspError("internal error; the server log has the details"), request)

    app.add_exception_handler(KvspError, kvsp_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


async def read_json_body(request: Request, max_octets: int) -> bytes:
    """The request body, if it is JSON of an accepted type and at most ``max_octets``."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type not in _ACCEPTED_TYPES:
        raise UnsupportedMediaType(
            f"content type {media_type or '(none)'!r} is not {JSON_MEDIA_TYPE}"
        )
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_octets:
        raise PayloadTooLarge(f"body of {declared} octets is above the {max_octets}-octet limit")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_octets:
            raise PayloadTooLarge(f"body is above the {max_octets}-octet limit")
    return bytes(body)


def parse_json_object(body: bytes) -> dict[str, Any]:
    """A JSON object from a body; anything else is a 400 ``RecordError``."""
    try:
        doc = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RecordError(f"body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise RecordError("body must be a JSON object")
    return doc


def principal_of(request: Request, principals: Principals) -> Principal:
    """The authenticated principal of ``request`` (401 if the token is missing or unknown)."""
    return principals.authenticate(request.headers.get("authorization"))
