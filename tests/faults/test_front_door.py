"""Hostile requests against a real Index Service process: every one answered with its problem
document, the service's memory bounded, and a well-behaved client served meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvsp.web.client import KEEPALIVE_EXPIRY_S
from kvsp.web.serving import FrontDoor
from tests.servers import Service, running

LIMITS = ["--http-limit", "head_timeout_s=1", "--http-limit", "connections=64"]


@pytest.fixture(scope="module")
def index() -> Iterator[Service]:
    service = Service("index", "serve", "--log-level", "warning", *LIMITS)
    with running(service):
        yield service


def _exchange(port: int, data: bytes, wait_s: float = 5.0) -> bytes:
    """Send ``data`` on a new connection; everything the server answers until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        with contextlib.suppress(OSError):  # closed while we were still sending: read on
            s.sendall(data)
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except OSError:
            pass
        return out


def _problem(answer: bytes) -> tuple[int, dict[str, object]]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"content-type: application/problem+json" in head.lower()
    doc = json.loads(body)
    assert doc["status"] == status
    return status, doc


def _rss_kb(service: Service) -> int:
    assert service.process is not None
    for line in Path(f"/proc/{service.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


HOSTILE = {
    "header line of 2 MB": (
        b"GET /kvsp/healthz HTTP/1.1\r\nX: " + b"a" * (2 << 20) + b"\r\n\r\n",
        431,
    ),
    "20,000 header fields": (
        b"GET /kvsp/healthz HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(20_000)),
        431,
    ),
    "request target of 64 KiB": (b"GET /" + b"a" * 65536 + b" HTTP/1.1\r\n\r\n", 414),
    "not HTTP": (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" * 8, 400),
    "upgrade": (
        b"GET /kvsp/healthz HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: h2c\r\n\r\n",
        None,  # served as a plain request, or refused: never a crash
    ),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_heads_are_refused_with_their_problem(index: Service, case: str) -> None:
    data, status = HOSTILE[case]
    answer = _exchange(index.port, data)
    if status is None:
        assert answer.startswith(b"HTTP/1.1 ")
        assert int(answer.split(b" ", 2)[1]) < 500
        return
    got, doc = _problem(answer)
    assert got == status, doc


def test_a_header_bomb_stalls_no_one_and_pins_no_memory(index: Service) -> None:
    """Twenty 8 MB header lines at once: each 431, RSS grows by far less than what was sent,
    and a well-behaved client is served meanwhile."""
    before = _rss_kb(index)
    bomb = b"GET /kvsp/healthz HTTP/1.1\r\nX: " + b"a" * (8 << 20) + b"\r\n\r\n"
    answers: list[bytes] = []
    threads = [
        threading.Thread(target=lambda: answers.append(_exchange(index.port, bomb, 30)))
        for _ in range(20)
    ]
    latencies = []
    for t in threads:
        t.start()
    with httpx.Client(timeout=10) as http:
        while not latencies or any(t.is_alive() for t in threads):
            started = time.perf_counter()
            assert http.get(index.base_url + "healthz").status_code == 200
            latencies.append(time.perf_counter() - started)
    for t in threads:
        t.join()
    assert [_problem(a)[0] for a in answers] == [431] * 20
    grown_mb = (_rss_kb(index) - before) / 1024
    print(f"header bomb: worst healthz {max(latencies) * 1000:.1f} ms, RSS +{grown_mb:.1f} MB")
    assert grown_mb < 40  # 160 MB were sent
    assert max(latencies) < 2.0


def test_slow_and_silent_connections_are_closed(index: Service) -> None:
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", index.port), timeout=10) as s:
        s.sendall(b"GET /kvsp/healthz HTTP/1.1\r\n")
        for _ in range(5):  # one octet a second would never finish a head
            time.sleep(0.3)
            try:
                s.sendall(b"X")
            except OSError:
                break
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    status, _ = _problem(answer)
    assert status == 408
    silent = _exchange(index.port, b"", 10)  # a connection that never says anything
    assert _problem(silent)[0] == 408
    assert time.monotonic() - started < 8


def test_connections_beyond_the_cap_are_turned_away_then_served(index: Service) -> None:
    held = [socket.create_connection(("127.0.0.1", index.port)) for _ in range(64)]
    try:
        time.sleep(0.2)
        status, _doc = _problem(_exchange(index.port, b"GET /kvsp/healthz HTTP/1.1\r\n\r\n"))
        assert status == 503
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    assert httpx.get(index.base_url + "healthz", timeout=5).status_code == 200


def test_deep_json_and_repeated_keys_are_400(index: Service) -> None:
    url = index.base_url
    with httpx.Client(timeout=30) as http:
        for path in ("replicas", "lookup"):
            deep = b'{"put":' + b"[" * 100_000
            r = http.post(url + path, content=deep, headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
            assert r.headers["content-type"] == "application/problem+json"
        key = "ab" * 32
        lookup = {"scope_id": "cd" * 16, "compat_id": "ef" * 32, "block_keys": [key] * 65_536}
        r = http.post(url + "lookup", json=lookup)
        assert r.status_code == 400
        assert "twice" in r.json()["detail"]
        assert http.get(url + "healthz").status_code == 200
    index.stop()
    assert b"Traceback" not in index.log
    index.start()


async def _lookups_through_a_stop(index: Service, stop_s: float) -> list[str]:
    """Lookups on kept-alive connections while the service is stopped for ``stop_s``: what
    went wrong (nothing should: a request sent during the stop is answered after it)."""
    assert index.process is not None
    assert index.process.pid is not None
    body = {"scope_id": "ab" * 16, "compat_id": "cd" * 32, "block_keys": ["ef" * 32]}
    errors: list[str] = []
    done = asyncio.Event()

    async def client() -> None:
        limits = httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:
            while not done.is_set():
                try:
                    answer = await http.post(index.base_url + "lookup", json=body)
                    if answer.status_code != 200:
                        errors.append(str(answer.status_code))
                except httpx.HTTPError as exc:
                    errors.append(repr(exc))
                await asyncio.sleep(0.05)

    clients = [asyncio.create_task(client()) for _ in range(3)]
    await asyncio.sleep(0.5)
    os.kill(index.process.pid, signal.SIGSTOP)
    await asyncio.sleep(stop_s)
    os.kill(index.process.pid, signal.SIGCONT)
    await asyncio.sleep(1.0)
    done.set()
    await asyncio.gather(*clients)
    return errors


@pytest.mark.anyio
async def test_requests_sent_while_the_service_was_stopped_are_answered(index: Service) -> None:
    """Stopped longer than its idle timeout, the service must not close kept-alive
    connections whose next request arrived meanwhile (it resets them otherwise)."""
    assert await _lookups_through_a_stop(index, FrontDoor().idle_timeout_s + 1) == []
