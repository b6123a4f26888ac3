"""The HTTP/1.1 client: head parsing, framing and chunked decoding as pure functions, then the
client against real servers on loopback sockets (canned answers for the cases a framework would
never send, uvicorn for the ordinary ones)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import uvloop
from hypothesis import given
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from kvsp.core.problems import InvalidInput, PeerTimeout, PeerUnreachable
from kvsp.core.problems import PeerAnswerTooLarge as BodyTooLarge
from kvsp.core.problems import PeerProtocolError as ProtocolError
from kvsp.web import http1
from kvsp.web.http1 import ChunkedDecoder, Http1Client, ResponseHead, ResponseReader, parse_head
from tests.servers import free_port, serving

# -- pure parts ------------------------------------------------------------------------------------


def test_parse_head_reads_status_and_joins_repeated_fields() -> None:
    head = parse_head(b"HTTP/1.1 404 Not Found\r\nContent-Length: 3\r\nVia: a\r\nvia:  b ")
    assert head.status == 404
    assert head.minor_version == 1
    assert head.headers == {"content-length": "3", "via": "a, b"}
    assert parse_head(b"HTTP/1.0 200").headers == {}


@pytest.mark.parametrize(
    "octets",
    [
        b"HTTP/2 200 OK",
        b"HTTP/1.1 20 OK",
        b"HTTP/1.1 abc OK",
        b"HTTP/1.1",
        b"ICY 200 OK",
        b"HTTP/1.1 200 OK\r\nno colon here",
        b"HTTP/1.1 200 OK\r\nA: 1\r\n folded",
        b"HTTP/1.1 200 OK\r\nName : value",
    ],
)
def test_parse_head_refuses_what_is_not_http_1(octets: bytes) -> None:
    with pytest.raises(ProtocolError):
        parse_head(octets)


def head(status: int = 200, version: int = 1, **fields: str) -> ResponseHead:
    return ResponseHead(version, status, {k.replace("_", "-"): v for k, v in fields.items()})


def test_framing_follows_rfc_9112() -> None:
    assert head(content_length="5").framing("GET") == ("length", 5)
    assert head(content_length="5, 5").framing("GET") == ("length", 5)
    assert head(content_length="0").framing("GET") == ("none", 0)
    assert head(content_length="5").framing("HEAD") == ("none", 0)
    assert head(204).framing("GET") == ("none", 0)
    assert head(304, content_length="9").framing("GET") == ("none", 0)
    assert head(transfer_encoding="chunked", content_length="5").framing("GET") == ("chunked", 0)
    assert head(transfer_encoding="gzip").framing("GET") == ("close", 0)
    assert head().framing("GET") == ("close", 0)
    for bad in ("5, 6", "-1", "0x5", "", "1" * 19):
        with pytest.raises(ProtocolError):
            head(content_length=bad).framing("GET")


def test_keep_alive_defaults_by_version() -> None:
    assert head().keep_alive()
    assert not head(connection="close").keep_alive()
    assert not head(version=0).keep_alive()
    assert head(version=0, connection="Keep-Alive").keep_alive()


def chunked(pieces: list[bytes], extension: bool, trailer: bool) -> bytes:
    out = b"".join(
        b"%x%s\r\n%s\r\n" % (len(p), b";name=value" if extension else b"", p) for p in pieces if p
    )
    return out + b"0\r\n" + (b"Trailer-Field: x\r\n" if trailer else b"") + b"\r\n"


@given(
    st.lists(st.binary(max_size=300), max_size=8),
    st.lists(st.integers(1, 64), min_size=1, max_size=20),
    st.booleans(),
    st.booleans(),
)
def test_chunked_decoding_is_independent_of_how_octets_arrive(
    pieces: list[bytes], cuts: list[int], extension: bool, trailer: bool
) -> None:
    encoded = chunked(pieces, extension, trailer) + b"NEXT"
    decoder, out, pos, used_total = ChunkedDecoder(), bytearray(), 0, 0
    for cut in cuts * (len(encoded) // sum(cuts) + 1):
        if pos >= len(encoded) or decoder.done:
            break
        data = memoryview(encoded[pos : pos + cut])
        parts, used = decoder.feed(data)
        for part in parts:
            out += part
        assert used == len(data) or decoder.done
        used_total += used
        pos += cut
    assert decoder.done
    assert bytes(out) == b"".join(pieces)
    assert encoded[used_total:] == b"NEXT"  # what follows the body is left alone


@pytest.mark.parametrize(
    "encoded",
    [b"zz\r\nab\r\n", b"2\r\nabc\r\n", b"2\nab\r\n", b"1" * 5000, b"-1\r\n", b"\r\n"],
)
def test_malformed_chunked_bodies_are_protocol_errors(encoded: bytes) -> None:
    with pytest.raises(ProtocolError):
        ChunkedDecoder().feed(memoryview(encoded))


def _read(method: str, answer: bytes, step: int) -> tuple[ResponseReader, bytes, int]:
    """Feed ``answer`` to a reader ``step`` octets at a time, as a connection would: the head
    from a buffer of what came so far, then the body; (reader, body, octets left over)."""
    reader = ResponseReader(method)
    pending = bytearray()
    body = bytearray()
    for at in range(0, len(answer), step):
        pending += answer[at : at + step]
        if reader.state == "head":
            del pending[: reader.take_head(pending)]
        if reader.state == "body" and pending:
            pieces, used = reader.take_body(memoryview(bytes(pending)))
            body += b"".join(pieces)
            del pending[:used]
    return reader, bytes(body), len(pending)


ANSWERS = [
    ("GET", b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", b"hello", "length"),
    ("GET", b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early\r\nLink: x\r\n\r\n"
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", b"ok", "length"),
    ("GET", b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3;x=y\r\nabc\r\n2\r\nde\r\n0\r\nTrailer: t\r\n\r\n", b"abcde", "chunked"),
    ("HEAD", b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\n", b"", "none"),
    ("GET", b"HTTP/1.1 204 No Content\r\n\r\n", b"", "none"),
]  # fmt: skip


@pytest.mark.parametrize(("method", "answer", "body", "framing"), ANSWERS)
@pytest.mark.parametrize("step", [1, 2, 7, 1 << 16])
def test_the_reader_frames_an_answer_however_its_octets_arrive(
    method: str, answer: bytes, body: bytes, framing: str, step: int
) -> None:
    reader, got, left = _read(method, answer, step)
    assert (reader.state, reader.framing, got, left) == ("done", framing, body, 0)
    assert reader.head is not None
    assert reader.head.status in (200, 204)


def test_a_close_delimited_body_ends_with_the_connection_and_nothing_else_does() -> None:
    reader, got, _ = _read("GET", b"HTTP/1.0 200 OK\r\n\r\npart", 1)
    assert (reader.state, reader.framing, got) == ("body", "close", b"part")
    reader.closed()
    assert reader.state == "done"
    cut, _, _ = _read("GET", b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\npart", 1)
    with pytest.raises(ProtocolError, match="mid-answer"):
        cut.closed()
    switched = ResponseReader("GET")
    with pytest.raises(ProtocolError, match="switched"):
        switched.take_head(b"HTTP/1.1 101 Switching Protocols\r\n\r\n")


def test_octets_after_the_answer_are_left_over_and_a_sized_body_may_skip_the_reader() -> None:
    reader, got, left = _read("GET", b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA", 64)
    assert (reader.state, got, left) == ("done", b"ok", 5)
    direct = ResponseReader("GET")
    direct.take_head(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n")
    direct.received(4)  # octets that went straight into the caller's buffer
    assert (direct.state, direct.left, direct.content_length) == ("body", 6, 10)
    direct.received(6)
    assert direct.state == "done"


# -- against servers -------------------------------------------------------------------------------


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Canned:
    """A loopback TCP server that answers with whatever the test writes, counting connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def request(self, reader: asyncio.StreamReader) -> bytes:
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        body = await reader.readexactly(length)
        self.requests.append(head + body)
        return head + body

    @asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}/"
        finally:
            server.close()
            await server.wait_closed()


def answers(*responses: bytes, then_close: bool = False) -> Callable[[Canned], Handler]:
    """A handler that reads a request and writes the next canned response, on every
    connection, until the connection ends."""

    def make(canned: Canned) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for response in responses:
                await canned.request(reader)
                writer.write(response)
                await writer.drain()
            if not then_close:
                await reader.read()

        return handler

    return make


def canned(make: Callable[[Canned], Handler]) -> Canned:
    server = Canned(lambda r, w: asyncio.sleep(0))
    server.handler = make(server)
    return server


@pytest.mark.anyio
async def test_a_sized_body_lands_in_the_callers_buffer_and_the_connection_is_reused() -> None:
    body = bytes(range(256)) * 40
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    server = canned(answers(answer, answer))
    async with server.running() as url:
        client = Http1Client(headers={"authorization": "Bearer t"})
        for _ in range(2):
            buffer = memoryview(bytearray(len(body) + 100))
            async with client.request("GET", url + "blocks", params={"layers": "0-1"}) as r:
                assert r.status == 200
                assert r.content_length == len(body)
                progress = [n async for n in r.fill(buffer)]
            assert progress == sorted(progress)
            assert progress[-1] == len(body)
            assert bytes(buffer[: len(body)]) == body
        await client.aclose()
    assert server.connections == 1
    assert server.requests[0].startswith(b"GET /blocks?layers=0-1 HTTP/1.1\r\n")
    assert b"authorization: Bearer t\r\n" in server.requests[0]


@pytest.mark.anyio
async def test_a_body_goes_to_the_requests_sink_only_when_2xx_sized_and_fitting() -> None:
    body = bytes(range(256)) * 400
    ok = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    problem = b"HTTP/1.1 404 Not Found\r\ncontent-length: 4\r\n\r\nnope"
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n"
    server = canned(answers(ok, problem, chunked, ok, ok, ok))
    async with server.running() as url:
        client = Http1Client()
        sink = memoryview(bytearray(len(body) + 7))
        async with client.request("GET", url, sink=sink) as r:
            assert r.in_request_sink
            with pytest.raises(ValueError, match="request's sink"):
                await r.receive(memoryview(bytearray(len(body))))
            assert await r.receive(None) == len(body)
        assert bytes(sink[: len(body)]) == body
        for answer in (b"nope", b"hi"):  # a problem document, a body of unknown length
            async with client.request("GET", url, sink=sink) as r:
                assert not r.in_request_sink
                with pytest.raises(ValueError, match="name a sink"):
                    await r.receive(None)
                assert await r.read(100) == answer
        small = memoryview(bytearray(len(body) - 1))
        async with client.request("GET", url, sink=small) as r:  # does not fit: named later
            assert not r.in_request_sink
            assert await r.receive(sink) == len(body)
        async with client.request("GET", url, sink=sink) as r:  # streamed: progress as before
            progress = [n async for n in r.fill(None)]
            assert progress[-1] == len(body)
            assert progress == sorted(progress)
        assert bytes(sink[: len(body)]) == body
        await client.aclose()
    assert server.connections == 1


@pytest.mark.anyio
async def test_receive_tells_of_every_arrival_from_the_octets_that_came_with_the_head() -> None:
    body = bytes(range(256)) * 400
    head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(2):
            await server.request(reader)
            writer.write(head + body[:1000])  # some of the body with the head
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(body[1000:])
            await writer.drain()
        await reader.read()

    server = Canned(handler)
    async with server.running() as url:
        client = Http1Client()
        for offered in (True, False):  # the request's sink, or one named once the head is in
            sink = memoryview(bytearray(len(body)))
            arrivals: list[int] = []
            async with client.request("GET", url, sink=sink if offered else None) as r:
                got = await r.receive(None if offered else sink, arrivals.append)
            assert got == len(body) == arrivals[-1]
            assert arrivals[0] == 1000  # told at once of what came with the head
            assert arrivals == sorted(set(arrivals))
            assert bytes(sink) == body
        await client.aclose()


@pytest.mark.anyio
async def test_chunked_and_interim_answers_and_request_bodies_in_parts() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await server.request(reader)
        assert request.endswith(b"\r\n\r\nheadpart-two")
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\n")
        writer.write(b"transfer-encoding: chunked\r\n\r\n5;x=y\r\nhello\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"6\r\n world\r\n0\r\nT: 1\r\n\r\n")
        await writer.drain()
        await reader.read()

    server = Canned(handler)
    async with server.running() as url:
        client = Http1Client()
        parts = (b"head", memoryview(b"part-two"))
        async with client.request("PUT", url + "x", body=parts) as response:
            assert response.status == 201
            assert response.content_length is None
            assert await response.read(100) == b"hello world"
        assert b"content-length: 12\r\n" in server.requests[0]
        await client.aclose()


@pytest.mark.anyio
async def test_a_body_delimited_by_close_is_read_and_the_connection_not_kept() -> None:
    answer = b"HTTP/1.0 200 OK\r\n\r\nuntil the end"
    server = canned(answers(answer, then_close=True))
    async with server.running() as url:
        client = Http1Client()
        for _ in range(2):
            async with client.request("GET", url) as response:
                assert await response.read(1000) == b"until the end"
        await client.aclose()
    assert server.connections == 2


@pytest.mark.anyio
async def test_a_body_above_the_buffer_or_limit_is_refused_and_the_connection_closed() -> None:
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n0123456789"
    chunked_answer = (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\na\r\n0123456789\r\n0\r\n\r\n"
    )
    server = canned(answers(answer, chunked_answer))
    async with server.running() as url:
        client = Http1Client()
        with pytest.raises(BodyTooLarge):
            async with client.request("GET", url) as response:
                await response.read(9)
        with pytest.raises(BodyTooLarge):
            async with client.request("GET", url) as response:
                [n async for n in response.fill(memoryview(bytearray(4)))]
        await client.aclose()
    assert server.connections == 2


@pytest.mark.anyio
async def test_an_idempotent_request_is_sent_again_when_a_kept_connection_was_closed() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")  # a connection ends at its next request, unanswered

    server = Canned(handler)
    async with server.running() as url:
        client = Http1Client()
        async with client.request("GET", url) as response:
            assert await response.read(10) == b"ok"
        async with client.request("GET", url) as response:  # sent twice, answered once
            assert await response.read(10) == b"ok"
        with pytest.raises(ProtocolError):  # not idempotent: never sent twice
            async with client.request("POST", url, body=[b"{}"]):
                pass
        await client.aclose()
    assert server.connections == 2


@pytest.mark.anyio
async def test_a_connection_idle_past_its_expiry_is_not_reused_so_a_post_survives_its_close(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The peer ends a kept connection at its next request (as a service closing an idle one
    at that moment would): a POST, never sent twice, gets through because it goes on a new
    connection once the kept one has been idle for the expiry."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await server.request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")

    monkeypatch.setattr(http1, "KEEPALIVE_EXPIRY_S", 0.05)
    server = Canned(handler)
    async with server.running() as url:
        client = Http1Client()
        for _ in range(2):
            async with client.request("POST", url, body=[b"{}"]) as response:
                assert await response.read(10) == b"ok"
            await asyncio.sleep(0.1)
        await client.aclose()
    assert server.connections == 2
    assert len(server.requests) == 2


@pytest.mark.anyio
async def test_a_silent_peer_times_out_and_a_malformed_answer_is_a_protocol_error() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    server = Canned(silent)
    async with server.running() as url:
        client = Http1Client()
        with pytest.raises(PeerTimeout):
            async with client.request("GET", url, timeout_s=0.2):
                pass
        await client.aclose()
    server = canned(answers(b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n"))
    async with server.running() as url:
        client = Http1Client()
        with pytest.raises(ProtocolError):
            async with client.request("GET", url):
                pass
        await client.aclose()
    server = canned(answers(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nshort", then_close=True))
    async with server.running() as url:
        client = Http1Client()
        with pytest.raises(ProtocolError, match=r"mid-answer|connection lost"):
            async with client.request("GET", url) as response:
                await response.read(100)
        await client.aclose()


@pytest.mark.anyio
async def test_no_more_connections_than_the_limit_and_uvicorn_answers_read_whole() -> None:
    open_now = peak = 0

    async def slow(request: Request) -> Response:
        nonlocal open_now, peak
        open_now += 1
        peak = max(peak, open_now)
        await asyncio.sleep(0.05)
        open_now -= 1
        return Response(b"x" * 100_000)

    async def stream(request: Request) -> StreamingResponse:
        async def parts() -> AsyncIterator[bytes]:
            for i in range(5):
                yield bytes([i]) * 1000

        return StreamingResponse(parts())

    app = Starlette(routes=[Route("/kvsp/slow", slow), Route("/kvsp/stream", stream)])
    async with serving(app) as base:
        client = Http1Client(connections=2)

        async def get(path: str) -> bytes:
            async with client.request("GET", base + path) as response:
                return await response.read(1 << 20)

        bodies = await asyncio.gather(*(get("slow") for _ in range(6)))
        assert bodies == [b"x" * 100_000] * 6
        assert peak <= 2
        assert await get("stream") == b"".join(bytes([i]) * 1000 for i in range(5))
        await client.aclose()


def test_the_same_answers_under_uvloop() -> None:
    """kvsp's services run under uvloop (uvicorn picks it), whose transports are its own."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(test_a_sized_body_lands_in_the_callers_buffer_and_the_connection_is_reused())
        runner.run(test_chunked_and_interim_answers_and_request_bodies_in_parts())
        runner.run(test_an_idempotent_request_is_sent_again_when_a_kept_connection_was_closed())
        runner.run(test_a_body_above_the_buffer_or_limit_is_refused_and_the_connection_closed())


@pytest.mark.anyio
async def test_nothing_can_split_a_request_line_or_field() -> None:
    client = Http1Client()
    for url, headers in (
        ("http://127.0.0.1:1/a b", {}),
        ("http://127.0.0.1:1/a\x00", {}),
        ("http://127.0.0.1:1/", {"x-a": "1\r\nx-b: 2"}),
        ("ftp://127.0.0.1/", {}),
    ):
        with pytest.raises(InvalidInput, match=r"control|not an http"):
            async with client.request("GET", url, headers=headers):
                pass
    with pytest.raises(InvalidInput, match="control"):
        Http1Client(headers={"authorization": "Bearer a\nb"})


@pytest.mark.anyio
async def test_the_host_field_never_carries_userinfo_from_the_url() -> None:
    answer = b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n"
    server = canned(answers(answer))
    async with server.running() as url:
        client = Http1Client()
        with_userinfo = url.replace("http://", "http://user:secret@")
        async with client.request("GET", with_userinfo + "x") as r:
            assert r.status == 204
        await client.aclose()
    (sent,) = server.requests
    host = url.removeprefix("http://").rstrip("/")
    assert f"host: {host}\r\n".encode() in sent
    assert b"secret" not in sent


@pytest.mark.anyio
async def test_a_refused_connection_is_peer_unreachable() -> None:
    """Every transport failure is in the error tree: nothing built-in escapes the client."""
    client = Http1Client()
    with pytest.raises(PeerUnreachable, match="no connection"):
        async with client.request("GET", f"http://127.0.0.1:{free_port()}/"):
            pass
