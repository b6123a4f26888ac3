"""How kvsp runs its services' ASGI apps: uvicorn behind a front door, each response sent in
one write.

The front door (``FrontDoor``, ``HttpProtocol``): uvicorn's httptools protocol bounds nothing
before the app sees a request. A 96 MB header line was accumulated whole (a 21 s stall of the
event loop), a head sent at one octet a second held its connection for ever, and a connection
that never sent anything was never closed. ``HttpProtocol`` counts a request's head octets as
they arrive and stops at ``head_octets`` (431), bounds the field count (431) and the request
target (414), gives the head ``head_timeout_s`` from its first octet (or from the connection's
start) and the body ``body_idle_s`` between octets (408; a body the app has not read yet is not
the client's delay), closes a connection idle between requests after ``idle_timeout_s``, and
turns a connection away beyond ``connections`` (503). Every rejection, uvicorn's own 400
included, is an RFC 9457 problem document, logged once.

Held writes: uvicorn writes a response's status line and fields as soon as the app sends
``http.response.start`` and the body when it sends ``http.response.body``; under uvloop each
write is a send of its own, so every answer costs two system calls and leaves as two segments.
Profiled under load on an index lookup (a 30 KB answer), the send of the head alone took a fifth
of the server's time, more than the lookup (decision 0006). ``HttpProtocol`` hands uvicorn a
transport that holds writes until the end of the event loop's step, when they go out together
in one ``writelines``; uvicorn's parsing, flow control and keep-alive rules are its own,
unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import logging
import re
import select
import sys
import time
from dataclasses import dataclass, fields, replace
from typing import Any

import httptools
import uvicorn
from uvicorn.config import STARTUP_FAILURE, LifespanType
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvsp.core.problems import (
    HeaderFieldsTooLarge,
    InvalidInput,
    KvspError,
    RequestTimeout,
    ServiceUnavailable,
    UriTooLong,
)
from kvsp.core.registries import PROBLEM_MEDIA_TYPE
from kvsp.web import context, tracing
from kvsp.web.server import header_value

__all__ = [
    "GC_YOUNG_ALLOCATIONS",
    "HELD_OCTETS_LIMIT",
    "LOG_FORMATS",
    "FrontDoor",
    "HeldWrites",
    "HttpProtocol",
    "JsonFormatter",
    "PrintableFormatter",
    "RequestContext",
    "configure_logs",
    "parse_front_door",
    "printable",
    "serve",
    "tune_collector",
    "uvicorn_config",
]

log = logging.getLogger("kvsp.http")

#: Held writes reaching this many octets go out at once, so that a response streamed in many
#: chunks within one step never sits outside the real transport's flow control.
HELD_OCTETS_LIMIT = 64 * 1024
#: how late a timeout may fire before it counts as the process's stall, not the client's
#: delay, and how long it then waits again
STALL_GRACE_S = 0.5


class HeldWrites(asyncio.Transport):
    """A transport that passes everything to ``transport`` but holds writes until the end of
    the loop's step (or until ``HELD_OCTETS_LIMIT`` octets are held), then writes them in
    order with one ``writelines``. Closing sends what is held first; aborting drops it."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._transport = transport
        self._loop = loop
        self._held: list[bytes | bytearray | memoryview] = []
        self._held_octets = 0
        self._flush_scheduled = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._held.append(data)
        self._held_octets += len(data)
        if self._held_octets >= HELD_OCTETS_LIMIT:
            self.flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._scheduled_flush)

    def writelines(self, list_of_data: Any) -> None:
        for data in list_of_data:
            self.write(data)

    def flush(self) -> None:
        """Write what is held now (dropped if the connection is already closing)."""
        held, self._held, self._held_octets = self._held, [], 0
        if held and not self._transport.is_closing():
            self._transport.writelines(held)

    def _scheduled_flush(self) -> None:
        self._flush_scheduled = False
        self.flush()

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held, self._held_octets = [], 0
        self._transport.abort()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def can_write_eof(self) -> bool:
        return self._transport.can_write_eof()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._transport.set_protocol(protocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self._transport.get_protocol()

    def is_reading(self) -> bool:
        return self._transport.is_reading()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._transport.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + self._held_octets

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._transport.get_write_buffer_limits()


@dataclass(frozen=True, slots=True)
class FrontDoor:
    """What one request or connection may cost a service before its app sees it."""

    #: octets of a request head (request line and fields)
    head_octets: int = 64 * 1024
    #: header fields in a request
    header_fields: int = 128
    #: octets of the request target
    target_octets: int = 8 * 1024
    #: seconds from a head's first octet (or a new connection) to its end
    head_timeout_s: float = 10.0
    #: seconds a request body may go without an octet while the app waits for it
    body_idle_s: float = 30.0
    #: seconds a kept-alive connection may stay idle between requests
    idle_timeout_s: float = 5.0
    #: open connections; one more is answered 503 and closed
    connections: int = 1024

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"front door limit {f.name} must be > 0")


def parse_front_door(settings: list[str], base: FrontDoor | None = None) -> FrontDoor:
    """``FrontDoor`` from ``NAME=VALUE`` settings (``--http-limit head_octets=32768``)."""
    door = base or FrontDoor()
    types = {f.name: f.type for f in fields(FrontDoor)}
    for setting in settings:
        name, sep, value = setting.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in types:
            raise ValueError(f"{setting!r}: expected NAME=VALUE with NAME one of {sorted(types)}")
        try:
            parsed: Any = float(value) if types[name] in (float, "float") else int(value)
        except ValueError:
            raise ValueError(f"{setting!r}: {value!r} is not a number") from None
        door = replace(door, **{name: parsed})
    return door


def _problem_octets(error: KvspError, retry_after_s: int | None = None) -> bytes:
    """A whole HTTP/1.1 answer carrying ``error``'s problem document; the connection closes."""
    body = json.dumps(error.to_problem()).encode()
    fields_ = [
        b"HTTP/1.1 %d %s\r\n" % (error.status, error.title.encode()),
        b"content-type: " + PROBLEM_MEDIA_TYPE.encode() + b"\r\n",
        b"content-length: %d\r\n" % len(body),
        b"connection: close\r\n",
    ]
    if retry_after_s is not None:
        fields_.append(b"retry-after: %d\r\n" % retry_after_s)
    return b"".join([*fields_, b"\r\n", body])


class _Rejected(Exception):
    """Raised in a parser callback to stop parsing; ``HttpProtocol`` answers ``error``."""

    def __init__(self, error: KvspError) -> None:
        super().__init__(error.detail)
        self.error = error


class HttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol behind ``FrontDoor``'s limits, writing through
    ``HeldWrites``."""

    def __init__(self, *args: Any, front_door: FrontDoor | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.door = front_door or FrontDoor()
        #: whether the parser is inside a request head (or waiting for one)
        self._in_head = True
        self._head_seen = 0
        self._fields = 0
        self._rejection: KvspError | None = None
        self._turned_away = False
        self._read_timer: asyncio.TimerHandle | None = None
        #: whether the running read timeout already waited once for a stall
        self._graced = False

    # -- connections ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.door.connections:
            self._turned_away = True
            error = ServiceUnavailable(f"more than {self.door.connections} open connections")
            log.warning("connection turned away: %s", error.detail)
            transport.write(_problem_octets(error, retry_after_s=1))
            transport.close()
            return
        super().connection_made(HeldWrites(transport, self.loop))
        self._arm(self.door.head_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._turned_away:
            return
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._turned_away:
            return  # answered and closing: nothing it sends is read
        if self._in_head and self.parser is not None:
            room = self.door.head_octets - self._head_seen
            if len(data) > room:  # feed what fits: the head may end within it
                self._head_seen += max(room, 0)
                self._feed(data[: max(room, 0)])
                if self._in_head and not self.transport.is_closing():
                    self._reject(
                        HeaderFieldsTooLarge(f"request head above {self.door.head_octets} octets")
                    )
                elif not self.transport.is_closing():
                    self.data_received(data[room:])
                return
            self._head_seen += len(data)
        self._feed(data)

    def _feed(self, data: bytes) -> None:
        """uvicorn's ``data_received``, with every failure answered as a problem document."""
        if not data:
            return
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(InvalidInput("protocol upgrades are not served"))
        except httptools.HttpParserError as exc:
            self._reject(self._rejection or InvalidInput(f"not an HTTP/1.1 request: {exc}"))

    def _reject(self, error: KvspError) -> None:
        self._disarm()
        log.info("%s %s: %s", error.status, error.slug, error.detail)
        self.transport.write(_problem_octets(error))
        self.transport.close()

    # -- parser callbacks ----------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._fields = True, 0
        self._arm(self.door.head_timeout_s)

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.door.target_octets:
            self._stop(UriTooLong(f"request target above {self.door.target_octets} octets"))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields += 1
        if self._fields > self.door.header_fields:
            self._stop(HeaderFieldsTooLarge(f"more than {self.door.header_fields} header fields"))
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        super().on_headers_complete()
        self._arm(self.door.body_idle_s)  # until the message is complete

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self._arm(self.door.body_idle_s)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()
        self._in_head, self._head_seen = True, 0

    def _stop(self, error: KvspError) -> None:
        self._rejection = error
        raise _Rejected(error)

    # -- read timers ---------------------------------------------------------------------------

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._graced = False
        self._read_timer = self.loop.call_later(seconds, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _stalled(self, timer: asyncio.TimerHandle | None) -> bool:
        """Whether a timeout should wait ``STALL_GRACE_S`` more instead of closing: octets
        wait unread on the socket (the process was stopped or starved, SIGSTOP or a busy CPU,
        and the client's request came meanwhile; closing now would reset a request that is
        already here), or ``timer`` fires well after its time for the same reason."""
        if timer is not None and self.loop.time() - timer.when() > STALL_GRACE_S:
            return True
        sock = self.transport.get_extra_info("socket") if self.transport is not None else None
        if sock is None:
            return False
        try:
            readable, _, _ = select.select([sock.fileno()], [], [], 0)
        except (OSError, ValueError):
            return False
        return bool(readable)

    def timeout_keep_alive_handler(self) -> None:
        if self._stalled(self.timeout_keep_alive_task):
            self.timeout_keep_alive_task = self.loop.call_later(
                STALL_GRACE_S, super().timeout_keep_alive_handler
            )
            return
        super().timeout_keep_alive_handler()

    def _read_timed_out(self) -> None:
        timer, self._read_timer = self._read_timer, None
        if self.transport is None or self.transport.is_closing():
            return
        if not self._graced and self._stalled(timer):  # once: a trickle of octets is no stall
            self._graced = True
            self._read_timer = self.loop.call_later(STALL_GRACE_S, self._read_timed_out)
            return
        if self._in_head:
            timeout = self.door.head_timeout_s
            self._reject(RequestTimeout(f"request head not received in {timeout} s"))
            return
        if self.flow.read_paused:  # the app has not read what came: not the client's delay
            self._arm(self.door.body_idle_s)
            return
        log.info("408 kvsp-request-timeout: no body octet in %s s", self.door.body_idle_s)
        self.transport.close()  # the app reading the body sees the client go away


def uvicorn_config(
    app: Any,
    host: str,
    port: int,
    log_level: str = "info",
    lifespan: LifespanType = "auto",
    front_door: FrontDoor | None = None,
) -> uvicorn.Config:
    """The uvicorn configuration every kvsp service runs with."""
    door = front_door or FrontDoor()
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=functools.partial(HttpProtocol, front_door=door),  # type: ignore[arg-type]
        lifespan=lifespan,
        log_level=log_level,
        log_config=None,  # configure_logs: uvicorn's lines in the service's format
        access_log=False,
        timeout_keep_alive=door.idle_timeout_s,  # type: ignore[arg-type]
        backlog=min(door.connections, 4096),
    )


_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def printable(text: str) -> str:
    """``text`` with every control character escaped (``\\x0a``): a value a client sent (a path,
    a header, a name) cannot start a forged line in a log."""
    return _CONTROLS.sub(lambda m: f"\\x{ord(m[0]):02x}", text)


class PrintableFormatter(logging.Formatter):
    """Log lines whose message has its control characters escaped; a traceback keeps its
    lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = printable(record.message)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line (``--log-format json``): time, level, service, logger,
    message, and the request and trace ids of the request being served, so a log store can
    join a line to its request and its trace. JSON escapes every control character."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        ids = context.current()
        if ids is not None:
            doc |= {"request_id": ids.request_id, "trace_id": ids.trace_id,
                    "span_id": ids.span_id}  # fmt: skip
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc)


JsonFormatter.converter = time.gmtime  # times in UTC, as the "Z" says


#: the log formats of ``--log-format``
LOG_FORMATS = ("text", "json")


def configure_logs(log_level: str, log_format: str = "text", service: str = "kvsp") -> None:
    """The ``kvsp`` and ``uvicorn`` loggers of a service process: ``log_level`` and up, one
    line each (``text``, or ``json`` objects), to standard error."""
    if log_format not in LOG_FORMATS:
        raise InvalidInput(f"--log-format must be one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter(service)
        if log_format == "json"
        else PrintableFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    for name in ("kvsp", "uvicorn"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(log_level.upper())
        logger.propagate = False


class RequestContext:
    """The ASGI app ``app`` with each HTTP request served under its ids
    (``kvsp.web.context``): its log lines and its calls to peers carry them, and the answer
    names its request id (``x-request-id``)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ids = context.request_ids(
            header_value(scope, b"x-request-id"), header_value(scope, b"traceparent")
        )
        named = (b"x-request-id", ids.request_id.encode())

        async def send_named(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), named]}
            await send(message)

        with tracing.server_span(scope["method"], scope["path"], ids):
            await self.app(scope, receive, send_named)


#: allocations between the cyclic collector's young collections in kvsp's services (CPython's
#: default is 700): see ``tune_collector``
GC_YOUNG_ALLOCATIONS = 50_000


def tune_collector() -> None:
    """Collect young objects every ``GC_YOUNG_ALLOCATIONS`` allocations, not every 700.

    A service that holds millions of objects (the IS's records, an ingest's chain states)
    allocates many that live on, and each young collection walks every survivor since the
    last one: at CPython's default the collector took half the time of storing records
    (decision 0024). Garbage in cycles, which is rare here, waits a little longer."""
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_ALLOCATIONS, middle, old)


def serve(
    app: Any,
    host: str,
    port: int,
    log_level: str = "info",
    front_door: FrontDoor | None = None,
    service: str = "kvsp",
) -> None:
    """Run ``app`` until the process is stopped, as ``uvicorn.run`` would: a server that could
    not start (its port taken) ends the process with uvicorn's startup-failure status. Its
    logs are the caller's to configure (``configure_logs``) before anything is logged."""
    tracing.configure_tracing(service)
    tune_collector()
    server = uvicorn.Server(
        uvicorn_config(RequestContext(app), host, port, log_level, front_door=front_door)
    )
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)
