"""A ``kvsp up`` cluster under a bounded mixed load (completions, lookups, block GETs) while
its instances are stopped past their TTL and resumed, its Index Service is stopped for 5 s, and
a header bomb and slowloris run against it. It must end with every instance active again and
a completion served within 10 s of the last fault, with no internal error anywhere."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from kvsp.local import LocalCluster, Process
from kvsp.model import ModelFiles
from kvsp.web.client import KEEPALIVE_EXPIRY_S

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


class Load:
    """Well-behaved clients: what they got back, and how long the slowest answer took."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.cluster = cluster
        self.statuses: Counter[str] = Counter()
        self.worst_s: Counter[str] = Counter()
        self.stop = asyncio.Event()

    async def _loop(self, what: str, call: object) -> None:
        # kvsp's own clients' keep-alive expiry, below the services' idle timeout: a client
        # that keeps an idle connection as long as the server does races its close
        limits = httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S)
        async with httpx.AsyncClient(timeout=60, limits=limits) as http:
            while not self.stop.is_set():
                started = time.monotonic()
                try:
                    answer = await call(http)  # type: ignore[operator]
                    self.statuses[f"{what} {answer.status_code}"] += 1
                except httpx.HTTPError as exc:
                    self.statuses[f"{what} {type(exc).__name__}"] += 1
                took = time.monotonic() - started
                self.worst_s[what] = max(self.worst_s[what], took)
                await asyncio.sleep(0.05)

    def run(self) -> list[asyncio.Task[None]]:
        c = self.cluster
        key = {"authorization": f"Bearer {c.api_key}"}
        operator = {"authorization": f"Bearer {c.operator_token}"}
        completion = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        lookup = {"scope_id": "ab" * 16, "compat_id": "cd" * 32, "block_keys": ["ef" * 32]}
        block = f"blocks/{'cd' * 32}/{'ab' * 16}/{'ef' * 32}"
        calls = {
            "completion": lambda h: h.post(
                f"{c.controller.url}v1/completions", json=completion, headers=key
            ),
            "lookup": lambda h: h.post(f"{c.index.url}lookup", json=lookup, headers=operator),
            "block": lambda h: h.get(f"{c.holder.url}{block}", headers=operator),
        }
        return [asyncio.create_task(self._loop(what, call)) for what, call in calls.items()]


def _signal(process: Process, sig: int) -> None:
    assert process.popen is not None
    os.kill(process.popen.pid, sig)


def _header_bomb(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        with contextlib.suppress(OSError):
            s.sendall(b"GET /kvsp/healthz HTTP/1.1\r\nX: " + b"a" * (8 << 20) + b"\r\n\r\n")
        return int(s.recv(64).split(b" ", 2)[1])


def _slowloris(port: int, seconds: float) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"GET /kvsp/healthz HTTP/1.1\r\n")
        deadline = time.monotonic() + seconds
        with contextlib.suppress(OSError):
            while time.monotonic() < deadline:
                s.sendall(b"X")
                time.sleep(1.0)
        return s.recv(64)


async def _all_active(cluster: LocalCluster) -> bool:
    view = await asyncio.to_thread(cluster.view)
    return len(view) == len(cluster.instance_processes) and all(
        i["state"] == "active" for i in view
    )


async def test_a_cluster_under_load_and_faults_heals_by_itself(
    tmp_path: Path, model_files: ModelFiles
) -> None:
    cluster = LocalCluster(tmp_path / "cluster", instances=2, status_ttl_ms=1_500)
    await asyncio.to_thread(cluster.start)
    load = Load(cluster)
    try:
        tasks = load.run()
        await asyncio.sleep(3)
        first, second = cluster.instance_processes
        # 1. one instance stopped for four TTLs, then resumed
        _signal(first, signal.SIGSTOP)
        await asyncio.sleep(6)
        _signal(first, signal.SIGCONT)
        # 2. the Index Service stopped for 5 s
        _signal(cluster.index, signal.SIGSTOP)
        await asyncio.sleep(5)
        _signal(cluster.index, signal.SIGCONT)
        # 3. a header bomb at the controller and slowloris at the holder, at once
        bombs = [asyncio.to_thread(_header_bomb, cluster.controller.port) for _ in range(8)]
        slow = [asyncio.to_thread(_slowloris, cluster.holder.port, 15) for _ in range(8)]
        answered = await asyncio.gather(*bombs, *slow)
        assert answered[:8] == [431] * 8
        assert all(a.startswith(b"HTTP/1.1 408") for a in answered[8:])
        # 4. both instances stopped past their TTL, then resumed
        for p in (first, second):
            _signal(p, signal.SIGSTOP)
        await asyncio.sleep(4)
        for p in (first, second):
            _signal(p, signal.SIGCONT)
        last_fault = time.monotonic()
        while not await _all_active(cluster):
            assert time.monotonic() - last_fault < 10, await asyncio.to_thread(cluster.view)
            await asyncio.sleep(0.1)
        async with httpx.AsyncClient(timeout=30) as http:
            answer = await http.post(
                f"{cluster.controller.url}v1/completions",
                json={"prompt": "Hello", "max_tokens": 2, "temperature": 0},
                headers={"authorization": f"Bearer {cluster.api_key}"},
            )
        healed_s = time.monotonic() - last_fault
        assert answer.status_code == 200, answer.text
        print(f"served {healed_s:.2f} s after the last fault; {dict(load.statuses)}")
        print(f"worst latency per client: {dict(load.worst_s)}")
        assert healed_s < 10
        load.stop.set()
        await asyncio.gather(*tasks)
    finally:
        load.stop.set()
        await asyncio.to_thread(cluster.stop)
    assert load.statuses["completion 200"] > 0
    # no internal error and no request lost on the way: every answer a status code, and a 5xx
    # only for a completion asked while no instance was alive (503)
    bad = [s for s in load.statuses if not s.split()[1].isdigit() or s.split()[1] >= "500"]
    assert set(bad) <= {"completion 503"}, dict(load.statuses)
    for log in (tmp_path / "cluster" / "logs").iterdir():
        assert b"Traceback" not in log.read_bytes(), log.name
