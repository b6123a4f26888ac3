"""Block GETs from kvsp's holder against the stores kvsp's users would pick instead, on the same
octets in the same run. Prints one JSON line.

For SmolLM2-sized blocks (737,780 octets) and 2 MiB blocks, with 1 and 8 concurrent clients in
one process, every contender serving the same 24 containers from another process on loopback:

- ``kvsp``: ``HolderClient.get`` from a ``kvsp holder serve`` process, each client receiving
  into a buffer of its own, and every octet verified (``Repr-Digest``, every layer digest, the
  replica digest); the peers check nothing;
- ``mooncake``: Mooncake Store's ``get_into`` over TCP from a store process that mounts the
  memory, the client mounting none (benchmarks/peers/mooncake_store.py);
- ``lmcache``: LMCache's ``lmcache_server`` with its own wire messages
  (benchmarks/peers/lmcache_server.py);
- ``redis`` and ``valkey``: redis-py (hiredis) ``GET`` from ``redis-server`` and from Valkey's
  ``valkey-server``.

Every contender's octets are checked once before any timing. Rounds of all contenders are
interleaved; each figure is the median over the rounds and each ratio (kvsp / peer) the median
of the rounds' own ratios. Targets: / Mooncake >= 1.0 with 1 client and >= 2.0 with 8;
/ redis-py >= 1.0 with 1 and 8. Printed beside them, measured in the same run: the bound that
verification sets here (``verify_only``: the digests alone over filled buffers on both cores)
and the bare socket (``raw``: the same octets from a socket server read with ``recv_into``).

Needs ``make peer-deps`` (``make bench-peers`` runs it).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import shutil
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis.asyncio as aioredis
from tests.servers import RedisServer, free_port

from benchmarks._peers import PeerDriver, interleaved, report, versus
from benchmarks.holder_transfer import (
    BLOCKS,
    COMPAT,
    SCOPE,
    SHAPES,
    async_rate,
    holder_service,
    make_container,
    raw_rate,
    raw_server,
    verify_only_rate,
)
from kvsp.core.container import Container
from kvsp.holder.client import HolderClient

ROUNDS = 5
ROUND_SECONDS = 1.5
CLIENTS = (1, 8)
TARGETS = {("mooncake", 1): 1.0, ("mooncake", 8): 2.0, ("redis", 1): 1.0, ("redis", 8): 1.0}

Measure = Callable[[], Awaitable[float]]


def raw_ceiling(payloads: list[bytes]) -> dict[int, float]:
    """Octets/s of a bare socket server process answering the same payloads."""
    port, ready = free_port(), multiprocessing.Event()
    server = multiprocessing.Process(target=raw_server, args=(port, payloads, ready), daemon=True)
    server.start()
    ready.wait(10)
    try:
        sizes = [len(p) for p in payloads]
        return {
            clients: max(raw_rate(port, sizes, clients) for _ in range(2)) for clients in CLIENTS
        }
    finally:
        server.kill()


async def redis_like(
    url: str, blobs: list[bytes], tag: str
) -> tuple[aioredis.Redis, Callable[[int], Measure]]:
    store = aioredis.Redis.from_url(url, max_connections=16)
    for n, blob in enumerate(blobs):
        await store.set(f"{tag}:{n}", blob)
        if await store.get(f"{tag}:{n}") != blob:
            raise RuntimeError(f"{url} gave back other octets")

    async def get(_: int, n: int) -> int:
        value = await store.get(f"{tag}:{n}")
        assert value is not None
        return len(value)

    return store, lambda clients: lambda: async_rate(get, clients, len(blobs), ROUND_SECONDS)


def peer_measure(
    driver: PeerDriver, blobs: list[bytes], tag: str, folder: Path
) -> Callable[[int], Measure]:
    path = folder / f"{tag}.bin"
    path.write_bytes(b"".join(blobs))
    driver.call("load", blobs=str(path), sizes=[len(b) for b in blobs], tag=tag)
    if not driver.call("check", blobs=str(path))["same_octets"]:
        raise RuntimeError(f"{tag}: the peer gave back other octets")

    def measure(clients: int) -> Measure:
        async def rate() -> float:
            return float(
                driver.call("rate", clients=clients, seconds=ROUND_SECONDS)["octets_per_s"]
            )

        return rate

    return measure


async def shape_figures(
    containers: list[Container], holder_url: str, stores: dict[str, str],
    drivers: dict[str, PeerDriver], folder: Path, name: str,
) -> dict[str, Any]:  # fmt: skip
    blobs = [c.tobytes() for c in containers]
    measures: dict[str, Callable[[int], Measure]] = {}
    async with HolderClient() as client:
        records = [
            await client.put(holder_url, (COMPAT, SCOPE, c.sha256().hex()), c) for c in containers
        ]
        buffers = [
            memoryview(bytearray(max(c.size for c in containers))) for _ in range(max(CLIENTS))
        ]

        async def holder_get(i: int, n: int) -> int:
            return (await client.get(records[n], buffer=buffers[i])).size

        measures["kvsp"] = lambda clients: (
            lambda: async_rate(holder_get, clients, len(records), ROUND_SECONDS)
        )
        opened = []
        for peer, url in stores.items():
            store, measure = await redis_like(url, blobs, f"{name}-{peer}")
            opened.append(store)
            measures[peer] = measure
        for peer, driver in drivers.items():
            measures[peer] = peer_measure(driver, blobs, f"{name}-{peer}", folder)
        out: dict[str, Any] = {}
        for clients in CLIENTS:
            figures = await interleaved({p: m(clients) for p, m in measures.items()}, ROUNDS)
            case: dict[str, Any] = {"kvsp_mb_per_s": round(median_mb(figures["kvsp"]), 1)}
            for peer in measures:
                if peer != "kvsp":
                    pair = versus(figures["kvsp"], figures[peer])
                    case[peer] = {"mb_per_s": round(pair["peer"] / 1e6, 1), "ratio": pair["ratio"],
                                  "ratio_range": pair["ratio_range"]}  # fmt: skip
            out[clients] = case
        for store in opened:
            await store.aclose()
    return out


def median_mb(figures: list[float]) -> float:
    return sorted(figures)[len(figures) // 2] / 1e6


def main() -> None:
    for program in ("redis-server", "valkey-server"):
        if shutil.which(program) is None:
            sys.exit(f"{program} is not installed: run `make peer-deps`")
    results: dict[str, Any] = {}
    meets = True
    redis_server, valkey_server = (
        RedisServer().start(),
        RedisServer(program="valkey-server").start(),
    )
    holder = holder_service()
    try:
        with (
            PeerDriver("mooncake", "mooncake_store") as mooncake,
            PeerDriver("lmcache", "lmcache_server") as lmcache,
            tempfile.TemporaryDirectory() as tmp,
        ):
            for s, (name, layers, section) in enumerate(SHAPES):
                containers = [make_container(1000 * s + n, layers, section) for n in range(BLOCKS)]
                figures = asyncio.run(shape_figures(
                    containers, holder.base_url,
                    {"redis": redis_server.url, "valkey": valkey_server.url},
                    {"mooncake": mooncake, "lmcache": lmcache}, Path(tmp), name,
                ))  # fmt: skip
                raw = raw_ceiling([c.tobytes() for c in containers])
                verify = max(verify_only_rate(containers) for _ in range(2))
                for clients, case in figures.items():
                    case["raw_socket_mb_per_s"] = round(raw[clients] / 1e6, 1)
                    case["verify_only_mb_per_s"] = round(verify / 1e6, 1)
                    for (peer, n), target in TARGETS.items():
                        if n == clients:
                            case[peer]["target"] = target
                            meets = meets and case[peer]["ratio"] >= target
                    results[f"{name}_{clients}_clients"] = {
                        "block_octets": containers[0].size,
                        **case,
                    }
    finally:
        holder.stop()
        redis_server.stop()
        valkey_server.stop()
    report(
        "peer_block_get",
        {
            "mooncake": "Mooncake Store 0.3.13.post1 get_into over TCP (no checks)",
            "lmcache": "LMCache 0.5.6 lmcache_server, its wire messages (no checks)",
            "redis": "redis-py (hiredis) GET from redis-server (no checks)",
            "valkey": "redis-py (hiredis) GET from valkey-server 8 (no checks)",
        },
        meets,
        results,
    )


if __name__ == "__main__":
    main()
