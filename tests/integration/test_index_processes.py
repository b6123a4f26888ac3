"""The Index Service as real processes: client over the network, two IS processes on one
Redis, an IS killed, and Redis stopped and restarted under a running IS."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest

from kvsp.core.problems import ServiceUnavailable
from kvsp.core.records import LookupRequest
from kvsp.index.client import IndexClient
from tests.index.factories import COMPAT, SCOPE_A, key, principals_toml, replica
from tests.servers import RedisServer, Service, running

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


@pytest.fixture
def principals(tmp_path: Path) -> Path:
    path = tmp_path / "principals.toml"
    path.write_text(principals_toml())
    return path


def lookup(*ns: int) -> LookupRequest:
    return LookupRequest.parse(
        {"scope_id": SCOPE_A, "compat_id": COMPAT, "block_keys": [key(n) for n in ns]}
    )


def index(principals: Path, store: str = "memory") -> Service:
    return Service(
        "index", "serve", "--auth", str(principals), "--store", store, "--log-level", "warning"
    )


async def test_a_real_server_with_the_client(principals: Path) -> None:
    server = index(principals)
    with running(server):
        async with (
            IndexClient(server.base_url, "h1") as holder,
            IndexClient(server.base_url, "pc") as pc,
        ):
            await holder.batch(put=[replica(n) for n in range(8)])
            answer = await pc.lookup(lookup(*range(10)))
            assert answer.matched == 8
            response = httpx.post(
                server.base_url + "lookup",
                content=b"{}",
                headers={"content-type": "application/json"},
            )
            assert response.status_code == 401
            assert response.headers["content-type"] == "application/problem+json"
    assert server.log.count(b"Traceback") == 0


async def test_two_index_processes_share_one_redis(principals: Path) -> None:
    redis = RedisServer()
    with running(redis):
        a, b = index(principals, redis.url), index(principals, redis.url)
        with running(a, b):
            async with (
                IndexClient(a.base_url, "h1") as via_a,
                IndexClient(b.base_url, "pc") as via_b,
            ):
                await via_a.publish(replica(0))
                await via_a.publish(replica(1, ttl_ms=300))
                assert (await via_b.lookup(lookup(0, 1))).matched == 2
                time.sleep(1.5)  # past the TTL and a few expiry rounds of both processes
                assert (await via_b.lookup(lookup(0, 1))).matched == 1
                async with IndexClient(b.base_url, "scraper") as scraper:
                    metrics = await scraper.metrics()
                assert "kvsp_index_expired_records 1.0" in metrics
                a.stop(signal.SIGKILL)  # one IS dies; the records live on in Redis
                assert (await via_b.lookup(lookup(0))).matched == 1


async def test_redis_restart_under_a_running_index(principals: Path) -> None:
    redis = RedisServer()
    with running(redis):
        server = index(principals, redis.url)
        with running(server):
            async with (
                IndexClient(server.base_url, "h1") as holder,
                IndexClient(server.base_url, "pc") as pc,
            ):
                await holder.publish(replica(0))
                redis.stop()
                with pytest.raises(ServiceUnavailable):
                    await pc.lookup(lookup(0))
                health = httpx.get(server.base_url + "healthz", timeout=5)
                assert health.status_code == 503
                assert health.json()["type"].endswith("#kvsp-unavailable")
                redis.start()  # same port, empty (no persistence)
                deadline = time.monotonic() + 15
                while True:
                    try:
                        assert (await pc.lookup(lookup(0))).matched == 0
                        break
                    except ServiceUnavailable:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.2)
                await holder.publish(replica(0))
                assert (await pc.lookup(lookup(0))).matched == 1
        assert server.log.count(b"Traceback") == 0, server.log.decode()
