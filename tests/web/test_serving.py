"""``kvsp.web.serving``: writes made in one step of the event loop leave together, in order,
and nothing held is lost or sent late; a service served this way answers as uvicorn would."""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import subprocess
import sys
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from kvsp.web.serving import (
    GC_YOUNG_ALLOCATIONS,
    HELD_OCTETS_LIMIT,
    FrontDoor,
    HeldWrites,
    PrintableFormatter,
    parse_front_door,
    printable,
    tune_collector,
)
from tests.servers import serving

pytestmark = pytest.mark.anyio


class Pair:
    """A connected socket pair: ``held`` writes into one end, the test reads the other."""

    def __init__(self, transport: asyncio.Transport, peer: socket.socket) -> None:
        self.held = HeldWrites(transport, asyncio.get_running_loop())
        self.transport = transport
        self.peer = peer

    def available(self) -> bytes:
        """What has reached the peer so far, without waiting."""
        try:
            return self.peer.recv(1 << 20)
        except BlockingIOError:
            return b""

    async def read_to_end(self) -> bytes:
        loop = asyncio.get_running_loop()
        out = b""
        while chunk := await loop.sock_recv(self.peer, 1 << 20):
            out += chunk
        return out


@pytest.fixture
async def pair() -> AsyncIterator[Pair]:
    ours, peer = socket.socketpair()
    peer.setblocking(False)
    transport, _ = await asyncio.get_running_loop().connect_accepted_socket(asyncio.Protocol, ours)
    yield Pair(transport, peer)
    transport.abort()
    peer.close()


async def test_writes_of_one_step_leave_together_at_its_end(pair: Pair) -> None:
    pair.held.write(b"HTTP/1.1 200 OK\r\n\r\n")
    pair.held.writelines([b"one ", memoryview(b"two ")])
    pair.held.write(bytearray(b"three"))
    assert pair.held.get_write_buffer_size() == 19 + 13
    assert pair.available() == b""  # nothing before the step ends
    await asyncio.sleep(0)
    assert pair.available() == b"HTTP/1.1 200 OK\r\n\r\none two three"
    assert pair.held.get_write_buffer_size() == 0
    pair.held.write(b"next")  # a later step is held and sent on its own
    assert pair.available() == b""
    await asyncio.sleep(0)
    assert pair.available() == b"next"


async def test_held_octets_reaching_the_limit_go_out_at_once_in_order(pair: Pair) -> None:
    pair.held.write(b"head")
    pair.held.write(b"x" * HELD_OCTETS_LIMIT)
    first = pair.available()  # without the loop running
    assert first.startswith(b"headxxx")
    pair.held.write(b"tail")
    pair.held.close()
    rest = await pair.read_to_end()
    assert first + rest == b"head" + b"x" * HELD_OCTETS_LIMIT + b"tail"


async def test_close_sends_what_is_held_first(pair: Pair) -> None:
    pair.held.write(b"last words")
    pair.held.close()
    assert pair.held.is_closing()
    assert await pair.read_to_end() == b"last words"
    await asyncio.sleep(0)  # the scheduled flush finds nothing left and writes nothing


async def test_abort_drops_what_is_held(pair: Pair) -> None:
    pair.held.write(b"never sent")
    pair.held.abort()
    await asyncio.sleep(0)
    assert await pair.read_to_end() == b""


async def test_held_writes_on_a_closing_transport_are_dropped(pair: Pair) -> None:
    pair.held.write(b"too late")
    pair.transport.close()  # as when the connection is lost before the step ends
    await asyncio.sleep(0)
    assert await pair.read_to_end() == b""


async def test_the_rest_of_the_transport_is_the_real_one(pair: Pair) -> None:
    assert pair.held.get_extra_info("socket") is pair.transport.get_extra_info("socket")
    assert pair.held.get_protocol() is pair.transport.get_protocol()
    pair.held.pause_reading()
    assert not pair.held.is_reading()
    pair.held.resume_reading()
    assert pair.held.is_reading()
    pair.held.set_write_buffer_limits(high=1 << 20)
    assert pair.held.get_write_buffer_limits()[1] == 1 << 20
    assert pair.held.can_write_eof()
    pair.held.write(b"half")
    pair.held.write_eof()  # sends what is held, then ends this direction
    assert await pair.read_to_end() == b"half"


async def streamed(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers in many small chunks without waiting between them (no Content-Length)."""
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for n in range(10_000):
        await send({"type": "http.response.body", "body": b"%05d," % n, "more_body": True})
    await send({"type": "http.response.body", "body": b"end"})


async def test_served_answers_whole_and_in_order_with_keep_alive_and_close() -> None:
    expected = b"".join(b"%05d," % n for n in range(10_000)) + b"end"
    async with serving(streamed, lifespan="off") as base, httpx.AsyncClient() as client:
        for _ in range(3):  # one connection, kept alive
            assert (await client.get(base)).content == expected
        closing = await client.get(base, headers={"connection": "close"})
        assert closing.content == expected
        assert closing.headers["connection"] == "close"


def test_a_service_that_cannot_start_exits_with_uvicorns_startup_failure() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "kvsp", "index", "serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 3
    assert "address already in use" in done.stderr.lower()


def test_front_door_limits_come_from_name_value_settings() -> None:
    door = parse_front_door(["head_octets=32768", "head-timeout-s=2.5", "connections=8"])
    assert (door.head_octets, door.head_timeout_s, door.connections) == (32768, 2.5, 8)
    assert door.header_fields == FrontDoor().header_fields  # the rest keep their defaults
    for bad, says in [
        ("head_octets", "NAME=VALUE"),
        ("nope=1", "NAME=VALUE"),
        ("head_octets=lots", "not a number"),
        ("connections=0", "must be > 0"),
    ]:
        with pytest.raises(ValueError, match=says):
            parse_front_door([bad])


def test_a_logged_value_cannot_forge_a_line() -> None:
    """Control characters a client sent (a path with %0d%0a, an escape sequence) are escaped in
    the message; a traceback keeps its lines."""
    assert printable("/kvsp/x\r\nFORGED 200\x1b[2J\u2028") == (
        "/kvsp/x\\x0d\\x0aFORGED 200\\x1b[2J\\x2028"
    )
    formatter = PrintableFormatter("%(message)s")
    record = logging.LogRecord("kvsp.test", logging.INFO, __file__, 1, "GET %s", ("/a\nb",), None)
    assert formatter.format(record) == "GET /a\\x0ab"
    try:
        raise ValueError("x")
    except ValueError:
        failed = logging.LogRecord(
            "kvsp.test", logging.ERROR, __file__, 1, "failed\n", (), sys.exc_info()
        )
    text = formatter.format(failed)
    assert text.startswith("failed\\x0a\nTraceback")


def test_the_private_uvicorn_api_served_on_is_the_tested_one() -> None:
    """``HttpProtocol`` builds on uvicorn's ``HttpToolsProtocol``: the installed uvicorn is in
    the range pyproject.toml pins, and every method overridden is still there."""
    from importlib.metadata import version

    from packaging.requirements import Requirement
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    from kvsp.web.serving import HttpProtocol

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    pinned = next(
        Requirement(r) for r in project["project"]["optional-dependencies"]["server"]
        if r.startswith("uvicorn")
    )  # fmt: skip
    assert version("uvicorn") in pinned.specifier
    overridden = {n for n in vars(HttpProtocol) if callable(vars(HttpProtocol)[n])} - {"__init__"}
    assert overridden
    for name in overridden - {n for n in vars(HttpProtocol) if n.startswith("_")}:
        assert hasattr(HttpToolsProtocol, name), name


def test_tuning_the_collector_changes_only_how_often_young_objects_are_collected() -> None:
    before = gc.get_threshold()
    try:
        tune_collector()
        assert gc.get_threshold() == (GC_YOUNG_ALLOCATIONS, before[1], before[2])
        assert gc.isenabled()
    finally:
        gc.set_threshold(*before)
