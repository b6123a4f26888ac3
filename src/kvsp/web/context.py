"""Which request a line of a log or an outgoing call belongs to: a request id and a W3C trace
context (``traceparent``) per request, held in a context variable for the request's task and
everything it awaits.

A request arriving with ``x-request-id`` (printable, at most 64 characters) or a valid
``traceparent`` keeps them; otherwise the service makes new ones. The answer carries
``x-request-id``; every call a service makes while serving a request carries the request id
and a ``traceparent`` of the same trace with a new parent id, so one completion is one trace
id in every service's log (front end, controller, Index Service, instance, holder), whether or
not spans are exported (``kvsp.web.tracing``).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

__all__ = ["RequestIds", "current", "outgoing_headers", "request_ids", "using"]

_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,64}")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16


@dataclass(frozen=True, slots=True)
class RequestIds:
    """A request's id, its trace id and the id of the span that serves it here."""

    request_id: str
    trace_id: str
    span_id: str
    sampled: bool = True
    #: the caller's span (the ``traceparent`` it sent), if any
    parent_id: str | None = None

    def traceparent(self) -> str:
        """The ``traceparent`` a call made while serving this request carries: this trace,
        this span as the parent (W3C Trace Context, version 00)."""
        return f"00-{self.trace_id}-{self.span_id}-{'01' if self.sampled else '00'}"


_current: ContextVar[RequestIds | None] = ContextVar("kvsp_request", default=None)


def current() -> RequestIds | None:
    """The request being served in this task, if any."""
    return _current.get()


def request_ids(request_id: str | None, traceparent: str | None) -> RequestIds:
    """A request's ids from what it carried: the ones it sent when valid, new ones otherwise
    (an invalid ``traceparent`` starts a new trace, as W3C Trace Context says)."""
    rid = request_id if request_id is not None and _REQUEST_ID.fullmatch(request_id) else None
    parsed = _TRACEPARENT.fullmatch(traceparent.strip().lower()) if traceparent else None
    fresh = secrets.token_hex(32)  # one read of the system's random source, not three
    if parsed is not None and parsed[1] != _ZERO_TRACE and parsed[2] != _ZERO_SPAN:
        trace_id, sampled, parent = parsed[1], bool(int(parsed[3], 16) & 1), parsed[2]
    else:
        trace_id, sampled, parent = fresh[32:], True, None
    return RequestIds(rid or fresh[:16], trace_id, fresh[16:32], sampled, parent)


@contextmanager
def using(ids: RequestIds) -> Iterator[RequestIds]:
    """Serve with ``ids`` as the current request (for the block's task and what it awaits)."""
    token = _current.set(ids)
    try:
        yield ids
    finally:
        _current.reset(token)


def outgoing_headers() -> dict[str, str]:
    """The fields a call made now carries: the current request's id and trace (the span
    serving it as the parent); nothing outside a request."""
    ids = _current.get()
    if ids is None:
        return {}
    return {"x-request-id": ids.request_id, "traceparent": ids.traceparent()}
