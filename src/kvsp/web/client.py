"""Client-side HTTP plumbing: problem documents back into kvsp exceptions.

A kvsp client raises the same exception class the server raised (matched by problem type),
so callers handle a 404 ``kvsp-layers-unavailable`` or a 429 ``kvsp-lease-quota`` the same way
in process and across the network. A peer that cannot be reached, answers too late or breaks
HTTP is the transport branch of the tree (``PeerUnreachable``, ``PeerTimeout``,
``PeerProtocolError``: each a ``ServiceUnavailable``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Self

import httpx

from kvsp.core.problems import (
    PROBLEM_TYPE_BASE,
    CapacityExhausted,
    Forbidden,
    InvalidInput,
    KvspError,
    MethodNotAllowed,
    NotFound,
    NotLeader,
    PayloadTooLarge,
    PeerError,
    PeerProtocolError,
    PeerTimeout,
    PeerUnreachable,
    ServiceUnavailable,
    Unauthenticated,
    problem_types,
)
from kvsp.core.registries import JSON_MEDIA_TYPE
from kvsp.web.context import outgoing_headers

__all__ = [
    "KEEPALIVE_EXPIRY_S",
    "ClosingClient",
    "JsonClient",
    "auth_headers",
    "carry_request_ids",
    "peer_error",
    "problem_for",
    "raise_for_problem",
    "transport_errors",
]

_BY_SLUG = problem_types()
#: a peer that is not kvsp (another KVSP implementation) may answer with its own problem types,
#: or none: its status code then says which error it is
_BY_STATUS: dict[int, type[KvspError]] = {
    cls.status: cls
    for cls in (
        InvalidInput, Unauthenticated, Forbidden, NotFound, MethodNotAllowed, PayloadTooLarge,
        ServiceUnavailable, CapacityExhausted,
    )
}  # fmt: skip

#: httpx errors that mean "the peer is not there right now".
transport_errors = (httpx.TransportError,)


def peer_error(exc: httpx.TransportError, peer: str) -> PeerError:
    """An httpx transport failure as the error tree's transport branch."""
    detail = f"{peer} unreachable: {exc!r}"
    if isinstance(exc, httpx.TimeoutException):
        return PeerTimeout(detail)
    if isinstance(exc, httpx.RemoteProtocolError | httpx.DecodingError):
        return PeerProtocolError(detail)
    return PeerUnreachable(detail)


#: How long an idle connection is kept for reuse: shorter than the 5 s after which kvsp's
#: services (uvicorn) close idle connections, so a request is never sent on a connection the
#: service is closing at that moment (which fails it with a read error).
KEEPALIVE_EXPIRY_S = 2.0


class ClosingClient:
    """Base of kvsp's clients: ``async with`` closes the client's connections on the way out."""

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class JsonClient(ClosingClient):
    """An httpx client for a kvsp JSON service: bearer token, JSON content type, problem
    documents raised as kvsp errors, and an unreachable peer as ``ServiceUnavailable``.

    Given several base URLs (controllers sharing one state, of which one leads), a request
    that finds its URL unreachable or a standby (``NotLeader``) goes to the leader that one
    names, else to the next URL, until one answers or ``failover_s`` has passed; the URL that
    answered is tried first next time."""

    #: what the peer is called in errors ("index service", "instance")
    peer = "service"

    def __init__(
        self,
        base_url: str | Sequence[str] = "",
        token: str | None = None,
        timeout_s: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,
        failover_s: float = 0.0,
    ) -> None:
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        self._urls = [u if not u or u.endswith("/") else u + "/" for u in urls]
        self._current = 0
        self._failover_s = failover_s
        self._http = httpx.AsyncClient(
            base_url=self._urls[0] if len(self._urls) == 1 else "",
            headers={**auth_headers(token), "content-type": JSON_MEDIA_TYPE},
            timeout=timeout_s,
            transport=transport,
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S),
            event_hooks={"request": [carry_request_ids]},
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _send(
        self,
        method: str,
        url: str,
        body: bytes | None = None,
        params: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> httpx.Response:
        timeout = self._http.timeout if timeout_s is None else httpx.Timeout(timeout_s)
        deadline = time.monotonic() + self._failover_s
        pause = 0.05
        while True:
            try:
                return await self._attempt(self._current, method, url, body, params, timeout)
            except (PeerError, NotLeader) as exc:
                if len(self._urls) == 1 or time.monotonic() >= deadline:
                    raise
                self._current = self._next(exc)
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.25)

    async def _attempt(
        self,
        which: int,
        method: str,
        url: str,
        body: bytes | None = None,
        params: dict[str, str] | None = None,
        timeout: httpx.Timeout | float | None = None,
    ) -> httpx.Response:
        """One request to base URL number ``which``; a problem answer or a transport failure
        raised as the kvsp error it stands for."""
        base = "" if len(self._urls) == 1 else self._urls[which]
        try:
            response = await self._http.request(
                method, base + url, content=body, params=params, timeout=timeout
            )
        except transport_errors as exc:
            raise peer_error(exc, self.peer) from None
        raise_for_problem(response)
        return response

    async def first_ready(self, path: str = "readyz", timeout_s: float = 2.0) -> list[str]:
        """Why none of the URLs is ready: ``GET path`` at each in turn until one answers 2xx
        within ``timeout_s`` (then nothing); a probe's question, so no failover wait."""
        reasons = []
        for i, url in enumerate(self._urls):
            try:
                await self._attempt(i, "GET", path, timeout=timeout_s)
            except KvspError as exc:
                reasons.append(f"{url}: {exc.detail}")
                continue
            self._current = i
            return []
        return reasons

    def _next(self, exc: KvspError) -> int:
        """The URL to try after ``exc``: the leader a standby named, else the next one."""
        leader = exc.extensions.get("leader")
        if isinstance(leader, str) and leader in self._urls:
            named = self._urls.index(leader)
            if named != self._current:
                return named
        return (self._current + 1) % len(self._urls)


async def carry_request_ids(request: httpx.Request) -> None:
    """An httpx request hook: the call carries the request id and trace of the request being
    served (``kvsp.web.context``)."""
    for name, value in outgoing_headers().items():
        request.headers.setdefault(name, value)


def auth_headers(token: str | None) -> dict[str, str]:
    return {} if token is None else {"authorization": f"Bearer {token}"}


def problem_for(status: int, content: bytes, request: str) -> KvspError:
    """The kvsp exception a non-2xx answer stands for; ``request`` names it ("GET url")."""
    detail = f"{request} answered {status}"
    cls = _BY_STATUS.get(status, KvspError)
    extensions = {}
    try:
        doc = json.loads(content)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        slug = str(doc.get("type", "")).removeprefix(PROBLEM_TYPE_BASE)
        cls = _BY_SLUG.get(slug, cls)
        detail = str(doc.get("detail", detail))
        known = {"type", "title", "status", "detail", "instance"}
        extensions = {k: v for k, v in doc.items() if k not in known}
    return cls(detail, **extensions)


def raise_for_problem(response: httpx.Response) -> None:
    """Raise the kvsp exception a non-2xx response stands for."""
    if response.is_success:
        return
    request = f"{response.request.method} {response.request.url}"
    raise problem_for(response.status_code, response.content, request)
