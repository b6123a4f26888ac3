"""An HTTP/1.1 client whose response bodies land where the caller wants them.

Block octets are most of what kvsp moves, and every octet of a block is hashed twice on arrival
(KVSP 6.7), so each extra copy shows in time to first token. General-purpose clients read a
body into buffers of their own and hand out new ``bytes`` objects per read; here a response
with a ``Content-Length`` is received with ``recv_into`` straight into a buffer the caller gives
(the container a block is verified and parsed in), so the kernel's copy is the only one.
Chunked and close-delimited bodies are decoded from a small scratch buffer and copied in.

It does what kvsp's clients need and no more: one request at a time per connection,
keep-alive pools per origin with a connection limit, TLS, 1xx answers skipped, heads and bodies
bounded, one deadline per request. The framing rules are RFC 9112's (section 6.3), all of them
in the sans-IO ``ResponseReader`` (with ``parse_head`` and ``ChunkedDecoder``); the connection
is a thin ``BufferedProtocol`` shell that owns the buffers, the socket and the waiting. Its
failures are the error tree's transport branch: ``PeerUnreachable`` (no connection),
``PeerTimeout`` (no complete answer in time), ``PeerProtocolError`` (an answer that breaks the
framing or broke off; ``PeerAnswerTooLarge`` for a body above the caller's buffer), and
``InvalidInput`` for a request that cannot be written (not an http(s) URL, control
characters).
"""

from __future__ import annotations

import asyncio
import re
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Literal, cast
from urllib.parse import urlencode, urlsplit

from kvsp.core.problems import (
    InvalidInput,
    PeerAnswerTooLarge,
    PeerProtocolError,
    PeerTimeout,
    PeerUnreachable,
)
from kvsp.core.validation import decimal
from kvsp.web.client import KEEPALIVE_EXPIRY_S
from kvsp.web.context import outgoing_headers

__all__ = [
    "ChunkedDecoder",
    "Http1Client",
    "Response",
    "ResponseHead",
    "ResponseReader",
    "Transport",
    "parse_head",
    "tcp",
    "unix_socket",
]

#: the most octets a response head (status line and fields) may take
HEAD_LIMIT = 64 * 1024
_LINE_LIMIT = 4096
#: what would end or split a request line (in the target) or a field line
_NOT_IN_TARGET = re.compile(r"[\x00-\x20\x7f]")
_NOT_IN_FIELD = re.compile(r"[\x00-\x1f\x7f]")
_IDEMPOTENT = frozenset({"GET", "HEAD", "PUT", "DELETE", "OPTIONS"})

Framing = Literal["none", "length", "chunked", "close"]
Origin = tuple[str, str, int]


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """Status line and fields of a response (field names lowercase, repeats joined)."""

    minor_version: int
    status: int
    headers: Mapping[str, str]

    def keep_alive(self) -> bool:
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        if self.minor_version == 0:
            return "keep-alive" in tokens
        return "close" not in tokens

    def framing(self, method: str) -> tuple[Framing, int]:
        """How the body ends (RFC 9112 6.3), and its length when it has one."""
        if method == "HEAD" or self.status in (204, 304) or 100 <= self.status < 200:
            return "none", 0
        coding = self.headers.get("transfer-encoding")
        if coding is not None:
            if coding.split(",")[-1].strip().lower() != "chunked":
                return "close", 0
            return "chunked", 0
        length = self.headers.get("content-length")
        if length is None:
            return "close", 0
        values = {v.strip() for v in length.split(",")}
        octets = decimal(values.pop()) if len(values) == 1 else None
        if octets is None:
            raise PeerProtocolError(f"malformed Content-Length {length!r}")
        return ("length", octets) if octets else ("none", 0)


def parse_head(octets: bytes) -> ResponseHead:
    """The status line and fields, given the head without its final empty line."""
    try:
        text = octets.decode("latin-1")
        status_line, *lines = text.split("\r\n")
        version, code, *_ = status_line.split(" ", 2)
    except ValueError:
        raise PeerProtocolError("malformed status line") from None
    if version not in ("HTTP/1.1", "HTTP/1.0") or len(code) != 3 or decimal(code) is None:
        raise PeerProtocolError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
    headers: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or line[0] in " \t":
            raise PeerProtocolError(f"malformed field line {line[:80]!r}")
        key = name.lower()
        value = value.strip(" \t")
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return ResponseHead(int(version[-1]), int(code), headers)


class ChunkedDecoder:
    """The chunked transfer coding (RFC 9112 7.1), fed octets as they arrive (sans-IO)."""

    __slots__ = ("_left", "_line", "_state", "done")

    def __init__(self) -> None:
        self._state: Literal["size", "data", "data-end", "trailer"] = "size"
        self._left = 0
        self._line = bytearray()
        self.done = False

    def _take_line(self, data: memoryview, pos: int) -> tuple[bytes | None, int]:
        end = bytes(data[pos : pos + _LINE_LIMIT + 2]).find(b"\n")
        if end < 0:
            self._line += data[pos:]
            if len(self._line) > _LINE_LIMIT:
                raise PeerProtocolError("chunk line too long")
            return None, len(data)
        line = bytes(self._line + data[pos : pos + end])
        self._line.clear()
        if len(line) > _LINE_LIMIT or not line.endswith(b"\r"):
            raise PeerProtocolError("malformed chunk line")
        return line[:-1], pos + end + 1

    def feed(self, data: memoryview) -> tuple[list[memoryview], int]:
        """The body's data in ``data`` (views of it), and how many octets of it were used; all
        of them unless the body ended inside it."""
        out: list[memoryview] = []
        pos = 0
        while pos < len(data) and not self.done:
            if self._state == "data":
                take = min(self._left, len(data) - pos)
                out.append(data[pos : pos + take])
                pos += take
                self._left -= take
                if not self._left:
                    self._state = "data-end"
                continue
            line, pos = self._take_line(data, pos)
            if line is None:
                break
            if self._state == "size":
                size = line.split(b";", 1)[0].strip()
                if not size or len(size) > 15 or size.strip(b"0123456789abcdefABCDEF"):
                    raise PeerProtocolError(f"malformed chunk size {size[:20]!r}")
                self._left = int(size, 16)
                self._state = "data" if self._left else "trailer"
            elif self._state == "data-end":
                if line:
                    raise PeerProtocolError("chunk data longer than its size")
                self._state = "size"
            elif not line:  # the empty line after the trailer fields
                self.done = True
        return out, pos


ReaderState = Literal["head", "body", "done"]


class ResponseReader:
    """One response, sans-IO: the head found in the octets given (interim answers skipped),
    then where the body's octets end (RFC 9112 6.3). Every framing rule is here, so it is
    tested a byte at a time; the connection owns the buffers and the socket.

    States: ``head`` (waiting for the final head) -> ``body`` -> ``done``; a body-less answer
    goes from ``head`` to ``done``. A sized body may arrive in the caller's buffer without
    passing through here (``received``)."""

    __slots__ = ("_decoder", "content_length", "framing", "head", "left", "method", "state")

    def __init__(self, method: str) -> None:
        self.method = method
        self.state: ReaderState = "head"
        self.head: ResponseHead | None = None
        self.framing: Framing = "none"
        #: octets of a sized body still to come
        self.left = 0
        #: the body's length when the head states it
        self.content_length: int | None = None
        self._decoder: ChunkedDecoder | None = None

    def take_head(self, data: bytes | bytearray, stop: int | None = None) -> int:
        """How many octets of ``data`` (up to ``stop``) were interim answers and the final
        head (0 until a whole head is in)."""
        stop = len(data) if stop is None else stop
        used = 0
        while self.state == "head":
            end = data.find(b"\r\n\r\n", used, stop)
            if end < 0:
                break
            head = parse_head(bytes(data[used:end]))
            used = end + 4
            if head.status == 101:
                raise PeerProtocolError("the peer switched protocols")
            if head.status < 200:
                continue  # 100 Continue, 103 Early Hints: the answer follows
            self.head = head
            self.framing, self.left = head.framing(self.method)
            if self.framing in ("length", "none"):
                self.content_length = self.left
            if self.framing == "chunked":
                self._decoder = ChunkedDecoder()
            self.state = "done" if self.framing == "none" else "body"
        return used

    def take_body(self, data: memoryview) -> tuple[list[memoryview], int]:
        """The body's octets in ``data`` (views of it), and how many octets were used: all of
        them unless the body ended inside ``data``."""
        if self.state != "body":
            return [], 0
        if self.framing == "length":
            take = min(len(data), self.left)
            self.received(take)
            return [data[:take]], take
        if self.framing == "chunked":
            assert self._decoder is not None
            pieces, used = self._decoder.feed(data)
            if self._decoder.done:
                self.state = "done"
            return pieces, used
        return [data], len(data)  # close-delimited: everything until the peer closes

    def received(self, count: int) -> None:
        """``count`` octets of a sized body arrived in the caller's buffer."""
        self.left -= count
        if not self.left:
            self.state = "done"

    def closed(self) -> None:
        """The peer closed the connection: a close-delimited body ends there; any other
        answer is cut off."""
        if self.state == "body" and self.framing == "close":
            self.state = "done"
        elif self.state != "done":
            raise PeerProtocolError("the peer closed the connection mid-answer")


class _Connection(asyncio.BufferedProtocol):
    """One connection, one request at a time. The loop calls ``get_buffer``/``buffer_updated``;
    the requesting task waits on ``_waiter``, which every event wakes."""

    def __init__(self) -> None:
        self._scratch = bytearray(HEAD_LIMIT)
        self._view = memoryview(self._scratch)
        self._fill = 0
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self.closed = False
        self._reset("GET", None)

    def _reset(self, method: str, offered: memoryview | None) -> None:
        self._reader = ResponseReader(method)
        #: the request's sink: a 2xx body with a length that fits goes there as it arrives
        self._offered = offered
        #: whether the body goes to the request's sink (decided when the head arrived)
        self.in_offered = False
        #: whether the requesting task wants a wake-up per arrival (else at the end only)
        self._progress = True
        #: told, on the loop, how many octets are in the sink each time more have arrived
        self._on_arrival: Callable[[int], None] | None = None
        self._error: BaseException | None = None
        self._sink: memoryview | None = None
        self._in_sink = False
        self._filled = 0
        self.started = False

    @property
    def head(self) -> ResponseHead | None:
        return self._reader.head

    @property
    def content_length(self) -> int | None:
        """The body's length when the head states it."""
        return self._reader.content_length

    @property
    def body_done(self) -> bool:
        return self._reader.state == "done"

    # -- loop callbacks ----------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def get_buffer(self, sizehint: int) -> memoryview:
        reader = self._reader
        if self._sink is not None and reader.framing == "length" and reader.left:
            self._in_sink = True
            return self._sink[self._filled : self._filled + reader.left]
        self._in_sink = False
        if self._fill == len(self._scratch):  # a head above the limit: nothing more is read
            self._fail(PeerProtocolError(f"response head above {HEAD_LIMIT} octets"))
            return memoryview(bytearray(1))
        return self._view[self._fill :]

    def buffer_updated(self, nbytes: int) -> None:
        self.started = True
        if self._in_sink:
            self._filled += nbytes
            self._reader.received(nbytes)
            if self.body_done:
                self._body_ended()
            if self._on_arrival is not None:
                self._on_arrival(self._filled)
            if self._progress or self.body_done:
                self._wake()
            return
        self._fill += nbytes
        try:
            self._process()
        except PeerProtocolError as exc:
            self._fail(exc)

    def eof_received(self) -> bool:
        try:
            if self._sink is None and not self.body_done:  # nowhere for a body to end yet
                raise PeerProtocolError("the peer closed the connection mid-answer")
            self._reader.closed()
        except PeerProtocolError as exc:
            self._fail(exc)
        else:
            self._body_ended()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.body_done and self._error is None:
            if self._reader.framing == "close" and self._sink is not None and exc is None:
                self._reader.closed()
                self._body_ended()
            else:
                self._error = PeerProtocolError(f"connection lost: {exc!r}")
        self._wake()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def pause_writing(self) -> None:
        self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    # -- parsing -----------------------------------------------------------------------------------

    def _process(self) -> None:
        reader = self._reader
        if reader.state == "head":
            used = reader.take_head(self._scratch, self._fill)
            if used:
                self._consume(used)
            head = reader.head
            if head is None:
                return
            if self.body_done:  # a body-less answer
                self._body_ended()
            elif (
                self._offered is not None
                and reader.framing == "length"
                and 200 <= head.status < 300
                and reader.left <= len(self._offered)
            ):
                self._sink = self._offered
                self.in_offered = True
            elif self._transport is not None:
                self._transport.pause_reading()  # until the caller says where the body goes
            self._wake()
        if self._sink is not None:
            self._drain_scratch()

    def _consume(self, count: int) -> None:
        rest = self._fill - count
        self._view[:rest] = self._view[count : self._fill]
        self._fill = rest

    def _put(self, data: memoryview) -> None:
        assert self._sink is not None
        end = self._filled + len(data)
        if end > len(self._sink):
            raise PeerAnswerTooLarge(f"response body above {len(self._sink)} octets")
        self._sink[self._filled : end] = data
        self._filled = end

    def _drain_scratch(self) -> None:
        """Move body octets waiting in the scratch buffer into the sink."""
        data = self._view[: self._fill]
        pieces, used = self._reader.take_body(data)
        for piece in pieces:
            self._put(piece)
        if self.body_done:
            self._body_ended()
        if used < len(data):
            raise PeerProtocolError(f"{len(data) - used} octets after the end of the answer")
        self._fill = 0
        if used and self._on_arrival is not None:
            self._on_arrival(self._filled)
        self._wake()

    def _body_ended(self) -> None:
        """The reader says the body is over: nothing more goes to the sink, no deadline."""
        self._sink = None
        self._in_sink = False
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self.close()
        self._wake()

    # -- the requesting task ----------------------------------------------------------------------

    def close(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        if self._transport is not None and not self.closed:
            self.closed = True
            self._transport.close()

    @property
    def reusable(self) -> bool:
        head = self.head
        return (
            not self.closed
            and self.body_done
            and self._error is None
            and self._fill == 0
            and head is not None
            and head.keep_alive()
            and self._reader.framing != "close"
        )

    async def _wait(self) -> None:
        if self._error is None:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
            self._waiter = None
        if self._error is not None:
            raise self._error

    async def send(
        self,
        method: str,
        head: bytes,
        body: Sequence[bytes | memoryview],
        timeout_s: float,
        sink: memoryview | None,
    ) -> ResponseHead:
        """Write the request; return the response head once it has arrived."""
        assert self._transport is not None
        self._reset(method, sink)
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(
            timeout_s, self._fail, PeerTimeout(f"no complete answer within {timeout_s} s")
        )
        self._transport.write(head)
        for part in body:
            self._transport.write(part)
        if self._drained is not None:
            await self._drained
        while self.head is None:
            await self._wait()
        return self.head

    def _direct(self, sink: memoryview | None) -> None:
        """Make ``sink`` (None: the request's, which the body already goes to) where the body
        goes."""
        if self.in_offered:
            if sink is not None:
                raise ValueError("the body goes to the request's sink: fill with None")
            return
        if sink is None:
            raise ValueError("the body does not go to the request's sink: name a sink")
        reader = self._reader
        if reader.framing == "length" and reader.left > len(sink):
            error = PeerAnswerTooLarge(f"response body of {reader.left} octets above {len(sink)}")
            self._fail(error)
            raise error
        if not self.body_done:
            self._sink = sink
            try:
                self._drain_scratch()
            except PeerProtocolError as exc:
                self._fail(exc)
            if self._transport is not None and not self.closed:
                self._transport.resume_reading()

    async def fill(self, sink: memoryview | None) -> AsyncIterator[int]:
        """Receive the body into ``sink`` (None: into the request's sink, where it already
        goes); yield how many octets of it have arrived, each time more have. Raises
        ``PeerAnswerTooLarge`` (before reading on) when it cannot fit."""
        self._direct(sink)
        reported = 0
        while True:
            if self._error is not None:
                raise self._error
            if self._filled > reported:
                reported = self._filled
                yield reported
            if self.body_done:
                return
            await self._wait()

    async def receive(
        self, sink: memoryview | None, on_arrival: Callable[[int], None] | None = None
    ) -> int:
        """``fill`` with one wake-up at the end instead of one per arrival: the octets.
        ``on_arrival`` is called on the loop with the octets in the sink so far, at once and
        each time more have arrived (it must not raise)."""
        self._direct(sink)
        self._progress = False
        if on_arrival is not None:
            self._on_arrival = on_arrival
            if self._filled:
                on_arrival(self._filled)
        while not self.body_done and self._error is None:
            await self._wait()
        if self._error is not None:
            raise self._error
        return self._filled


class Response:
    """A response whose head has arrived; its body is read with ``fill`` or ``read``."""

    def __init__(self, connection: _Connection, head: ResponseHead) -> None:
        self._connection = connection
        self.status = head.status
        self.headers = head.headers
        #: the body's length when the head states it
        self.content_length = connection.content_length
        #: whether the body goes to the sink the request named (a 2xx answer whose
        #: Content-Length fits it): then ``fill`` and ``receive`` take None
        self.in_request_sink = connection.in_offered

    def fill(self, sink: memoryview | None) -> AsyncIterator[int]:
        """The body into ``sink`` as it arrives; yields the octets received so far."""
        return self._connection.fill(sink)

    async def receive(
        self, sink: memoryview | None, on_arrival: Callable[[int], None] | None = None
    ) -> int:
        """The whole body into ``sink``; the octets received. ``on_arrival`` is told, on the
        loop, how many octets are in so far, each time more have arrived (it must not raise)."""
        return await self._connection.receive(sink, on_arrival)

    async def read(self, max_octets: int) -> bytes:
        """The whole body; ``PeerAnswerTooLarge`` above ``max_octets``."""
        size = max_octets if self.content_length is None else self.content_length
        if size > max_octets:
            raise PeerAnswerTooLarge(f"response body of {size} octets above {max_octets}")
        sink = memoryview(bytearray(size))
        return bytes(sink[: await self.receive(sink)])


def _check_fields(fields: Mapping[str, str]) -> None:
    for pair in fields.items():
        if any(_NOT_IN_FIELD.search(text) for text in pair):
            raise InvalidInput(f"control characters in the header {pair[0]!r}")


#: makes a connection to an origin for a protocol (the seam a test or another socket type uses)
Transport = Callable[
    [Origin, ssl.SSLContext | None, Callable[[], "_Connection"]], Awaitable["_Connection"]
]


async def tcp(
    origin: Origin, tls: ssl.SSLContext | None, protocol: Callable[[], _Connection]
) -> _Connection:
    """A TCP connection to the origin's host and port (TLS when given a context)."""
    _, host, port = origin
    _, connected = await asyncio.get_running_loop().create_connection(protocol, host, port, ssl=tls)
    return connected


def unix_socket(path: str) -> Transport:
    """Connections to a Unix socket at ``path``, whatever the URL's host (a holder on the same
    machine, or a service a test serves in its own process without a TCP port)."""

    async def connect(
        origin: Origin, tls: ssl.SSLContext | None, protocol: Callable[[], _Connection]
    ) -> _Connection:
        _, connected = await asyncio.get_running_loop().create_unix_connection(
            protocol, path, ssl=tls, server_hostname=origin[1] if tls else None
        )
        return connected

    return connect


class Http1Client:
    """Keep-alive connection pools per origin (scheme, host, port), at most ``connections``
    open to each; requests beyond that wait for a connection to come free. A connection idle
    for ``KEEPALIVE_EXPIRY_S`` is closed instead of reused: kvsp's services close theirs after
    5 s, and a request sent as the peer closes fails, which only an idempotent one survives."""

    def __init__(
        self,
        connections: int = 64,
        headers: Mapping[str, str] | None = None,
        transport: Transport | None = None,
    ) -> None:
        self._limit = connections
        #: how a connection to an origin is made: TCP (and TLS for https) unless given
        self._transport = transport or tcp
        _check_fields(headers or {})
        self._headers = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        #: per origin, the idle connections and when each went idle (monotonic), oldest first
        self._idle: dict[Origin, list[tuple[_Connection, float]]] = {}
        self._slots: dict[Origin, asyncio.Semaphore] = {}
        self._busy: set[_Connection] = set()
        self._tls: ssl.SSLContext | None = None

    async def aclose(self) -> None:
        for pool in self._idle.values():
            for connection, _ in pool:
                connection.close()
        self._idle.clear()
        for connection in self._busy:
            connection.close()

    async def _connect(self, origin: Origin, timeout_s: float) -> _Connection:
        scheme, host, port = origin
        tls = None
        if scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        try:
            async with asyncio.timeout(timeout_s):
                protocol = await self._transport(origin, tls, _Connection)
        except TimeoutError:
            raise PeerTimeout(f"no connection to {host}:{port} within {timeout_s} s") from None
        except OSError as exc:  # refused, no route, no such name, TLS refused
            raise PeerUnreachable(f"no connection to {host}:{port}: {exc}") from None
        return protocol

    def _idle_connection(self, origin: Origin) -> _Connection | None:
        pool = self._idle.get(origin, [])
        fresh_since = time.monotonic() - KEEPALIVE_EXPIRY_S
        while pool:
            connection, idle_since = pool.pop()
            if idle_since >= fresh_since and not connection.closed:
                return connection
            connection.close()
        return None

    @asynccontextmanager
    async def request(
        self,
        method: str,
        url: str,
        *,
        params: Mapping[str, str] | None = None,
        headers: Mapping[str, str] | None = None,
        body: Sequence[bytes | memoryview] = (),
        timeout_s: float = 30.0,
        sink: memoryview | None = None,
    ) -> AsyncIterator[Response]:
        """Send a request; the response's head has arrived when this enters, and its body is
        read inside. The connection goes back to the pool when the body was read whole.

        A 2xx body whose Content-Length fits in ``sink`` goes there as it arrives, from the
        head on (``Response.in_request_sink``): the connection never stops reading between
        head and body."""
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https") or not parts.hostname:
            raise InvalidInput(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if scheme == "https" else 80)
        origin = (scheme, parts.hostname, port)
        target = parts.path or "/"
        query = "&".join(q for q in (parts.query, urlencode(params or {})) if q)
        if query:
            target += "?" + query
        length = sum(len(p) for p in body)
        if _NOT_IN_TARGET.search(target):
            raise InvalidInput(f"control characters or spaces in a request to {url!r}")
        # RFC 9110 7.2: Host is the authority without userinfo (never send credentials there)
        host = parts.netloc.rpartition("@")[2]
        _check_fields({**(headers or {}), "host": host})
        carried = {**outgoing_headers(), **(headers or {})}
        fields = "".join(f"{k}: {v}\r\n" for k, v in carried.items())
        framing = f"content-length: {length}\r\n" if body or method in ("PUT", "POST") else ""
        head = (
            f"{method} {target} HTTP/1.1\r\nhost: {host}\r\n{self._headers}{fields}{framing}\r\n"
        ).encode("latin-1")
        slots = self._slots.setdefault(origin, asyncio.Semaphore(self._limit))
        async with slots:
            connection, answer = await self._send(origin, method, head, body, timeout_s, sink)
            self._busy.add(connection)
            try:
                yield Response(connection, answer)
            except BaseException:
                connection.close()
                raise
            finally:
                self._busy.discard(connection)
            if connection.reusable:
                self._idle.setdefault(origin, []).append((connection, time.monotonic()))
            else:
                connection.close()

    async def _send(
        self,
        origin: Origin,
        method: str,
        head: bytes,
        body: Sequence[bytes | memoryview],
        timeout_s: float,
        sink: memoryview | None,
    ) -> tuple[_Connection, ResponseHead]:
        """On a kept-alive connection the peer may have closed meanwhile; an idempotent request
        that got no octet back is sent once more on a new connection."""
        connection = self._idle_connection(origin)
        if connection is not None:
            try:
                return connection, await connection.send(method, head, body, timeout_s, sink)
            except BaseException as exc:
                connection.close()
                closed_before_answer = (
                    isinstance(exc, PeerProtocolError | PeerUnreachable) and not connection.started
                )
                if not closed_before_answer or method not in _IDEMPOTENT:
                    raise
        connection = await self._connect(origin, timeout_s)
        try:
            return connection, await connection.send(method, head, body, timeout_s, sink)
        except BaseException:
            connection.close()
            raise
