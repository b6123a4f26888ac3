"""Index Service lookups with 1,000,000 replica records loaded. Prints one JSON line.

(a) in process on the memory store: 64-key lookups per second through ``IndexService``;
(b) over HTTP: the same lookups served as ``kvsp index serve`` serves them (uvicorn with
    ``kvsp.web.serving``) and driven by ``wrk``, as a ratio to a minimal app's request rate on
    uvicorn as it comes, under the same load in the same run (target >= 0.5). Also reported,
    served as kvsp serves: a "same I/O" app that decodes the same request bodies and sends an
    answer of the same size without looking anything up (the ceiling of any lookup served this
    way), and the minimal app itself;
(c) on the Redis store: ``RedisReplicaStore.lookup`` as a ratio to a raw redis-py pipeline
    reading the same keys (TIME + 64 HGETALL) in the same run (target >= 0.5);
and the memory store's resident memory per record, for records as a whole-block holder
publishes them (target <= 256 octets) and for records carrying 30 layer digests (target
<= 1,300; decision 0026).

Needs ``redis-server`` and ``wrk`` (``make bench`` installs both).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import uvicorn
from tests.servers import RedisServer, free_port

from kvsp.auth import Principals
from kvsp.core.clock import SystemClock
from kvsp.core.records import LookupRequest, ReplicaRecord
from kvsp.index.app import create_app
from kvsp.index.rules import IndexLimits
from kvsp.index.service import IndexService
from kvsp.index.stores import MemoryReplicaStore, RedisReplicaStore
from kvsp.web.serving import uvicorn_config

PROMPT_BLOCKS = 64
#: octets a record may take resident, plain and with 30 layer digests (decision 0026)
MEMORY_LIMIT = 256
MEMORY_LIMIT_DIGESTS = 1_300
COMPAT = "c0" * 32
SCOPE = "a1" * 16
LIMITS = IndexLimits(max_ttl_ms=3_600_000, max_records=10_000_000)
DEV = Principals.development_mode().authenticate(None)


def block_key(n: int) -> str:
    return hashlib.sha256(b"%d" % n).hexdigest()


def template(layer_digests: bool) -> ReplicaRecord:
    layers = 30
    digests = [hashlib.sha256(b"layer %d" % i).hexdigest() for i in range(layers)]
    doc: dict[str, Any] = {
        "block_key": block_key(0),
        "compat_id": COMPAT,
        "scope_id": SCOPE,
        "holder": "http://127.0.0.1:9101/kvsp/",
        "codec": 1,
        "size": 20 + 16 * layers + layers * 24_576,
        "digest": "sha-256:"
        + hashlib.sha256(b"".join(bytes.fromhex(d) for d in digests)).hexdigest(),
        "residency": [
            {"tier": "host", "layers": [0, 19]},
            {"tier": "disk", "layers": [20, 29], "read_mbit_per_s": 16_000},
        ],
        "ttl_ms": 3_600_000,
    }
    if layer_digests:
        doc["layer_digests"] = digests
    return ReplicaRecord.parse(doc)


def records(start: int, stop: int, base: ReplicaRecord) -> list[ReplicaRecord]:
    return [base.model_copy(update={"block_key": block_key(n)}) for n in range(start, stop)]


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def load_memory(store: MemoryReplicaStore, count: int, base: ReplicaRecord) -> float:
    """Load ``count`` records; returns resident octets per record."""
    gc.collect()
    before = rss()
    for start in range(0, count, 10_000):
        store.table.publish_many(records(start, min(start + 10_000, count), base))
    gc.collect()
    return (rss() - before) / count


def prompts(count: int, records_loaded: int) -> list[LookupRequest]:
    rng = random.Random(7)
    out = []
    for _ in range(count):
        first = rng.randrange(0, records_loaded - PROMPT_BLOCKS)
        keys = [block_key(n) for n in range(first, first + PROMPT_BLOCKS)]
        out.append(LookupRequest(scope_id=SCOPE, compat_id=COMPAT, block_keys=tuple(keys)))
    return out


async def rate(
    call: Callable[[LookupRequest], Awaitable[object]],
    requests: list[LookupRequest],
    seconds: float = 3.0,
) -> float:
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for request in requests:
            await call(request)
        done += len(requests)
    return done / (time.perf_counter() - start)


class Background:
    """A uvicorn server in a thread of this process (the loaded index lives here), configured
    as kvsp serves its services, or as uvicorn comes (``stock``: the reference app)."""

    def __init__(self, app: Any, stock: bool = False) -> None:
        self.port = free_port()
        config = (
            uvicorn.Config(app, "127.0.0.1", self.port, log_level="error", access_log=False)
            if stock
            else uvicorn_config(app, "127.0.0.1", self.port, "error", lifespan="on")
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Background:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        return self

    def __exit__(self, *_: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


async def minimal_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The limit for (b): read the request, answer a small JSON body."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": b'{"ok":true}'})


def same_io_app(answer: bytes) -> Callable[..., Awaitable[None]]:
    """The same request decoding and answer size as a lookup, with no lookup in between."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        json.loads(body)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", b"%d" % len(answer)),
                ],
            }
        )
        await send({"type": "http.response.body", "body": answer})

    return app


WRK_SCRIPT = """
local bodies = {}
local i = 0
init = function(args)
  for line in io.lines(args[1]) do bodies[#bodies + 1] = line end
end
request = function()
  i = i % #bodies + 1
  return wrk.format("POST", "/kvsp/lookup",
                    {["content-type"] = "application/kvsp+json"}, bodies[i])
end
"""


def wrk(port: int, bodies: Path, script: Path, seconds: int = 5) -> float:
    out = subprocess.run(
        [
            "wrk",
            "-t1",
            "-c32",
            f"-d{seconds}s",
            "-s",
            str(script),
            f"http://127.0.0.1:{port}/kvsp/lookup",
            "--",
            str(bodies),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    match = re.search(r"Requests/sec:\s+([0-9.]+)", out)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if match is None or errors is not None:
        raise RuntimeError(f"wrk failed: {out}")
    return float(match.group(1))


async def redis_part(count: int, requests: list[LookupRequest]) -> dict[str, float]:
    server = RedisServer().start()
    store = RedisReplicaStore(server.url, LIMITS)
    try:
        base = template(layer_digests=False)
        for start in range(0, count, 5_000):
            await store.publish(records(start, min(start + 5_000, count), base))
        raw = store._redis

        async def raw_pipeline(request: LookupRequest) -> object:
            pipe = raw.pipeline(transaction=False)
            pipe.time()
            for key in request.block_keys:
                pipe.hgetall(f"kvsp:r:{{{request.compat_id}:{request.scope_id}:{key}}}")
            return await pipe.execute()

        async def ours(request: LookupRequest) -> object:
            return await store.lookup(request.compat_id, request.scope_id, request.block_keys, ())

        sample = requests[:200]
        best_raw = best_ours = 0.0
        for _ in range(3):
            best_raw = max(best_raw, await rate(raw_pipeline, sample, 2.0))
            best_ours = max(best_ours, await rate(ours, sample, 2.0))
        return {
            "redis_store_lookups_per_s": round(best_ours),
            "raw_pipeline_lookups_per_s": round(best_raw),
            "redis_ratio": round(best_ours / best_raw, 3),
        }
    finally:
        await store.close()
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=1_000_000)
    args = parser.parse_args()
    for tool in ("wrk", "redis-server"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is not installed (make bench installs it)")

    with_digests = MemoryReplicaStore(SystemClock(), LIMITS)
    per_record_digests = load_memory(
        with_digests, min(args.records, 100_000), template(layer_digests=True)
    )
    del with_digests
    gc.collect()

    store = MemoryReplicaStore(SystemClock(), LIMITS)
    per_record = load_memory(store, args.records, template(layer_digests=False))
    service = IndexService(store)
    requests = prompts(2_000, args.records)

    async def in_process() -> float:
        best = 0.0
        for _ in range(3):
            best = max(best, await rate(lambda r: service.lookup(DEV, r), requests[:500], 2.0))
        return best

    in_process_rate = asyncio.run(in_process())

    with tempfile.TemporaryDirectory() as tmp:
        bodies = Path(tmp) / "bodies.txt"
        bodies.write_text("\n".join(r.model_dump_json(exclude_none=True) for r in requests))
        script = Path(tmp) / "lookup.lua"
        script.write_text(WRK_SCRIPT)
        answer = asyncio.run(service.lookup(DEV, requests[0]))
        http_rate = minimal_rate = same_io_rate = minimal_kvsp_rate = 0.0
        with (
            Background(create_app(service, Principals.development_mode())) as index_server,
            Background(minimal_app, stock=True) as minimal_server,
            Background(same_io_app(answer)) as same_io_server,
            Background(minimal_app) as minimal_kvsp_server,
        ):
            for _ in range(2):
                http_rate = max(http_rate, wrk(index_server.port, bodies, script))
                minimal_rate = max(minimal_rate, wrk(minimal_server.port, bodies, script))
                same_io_rate = max(same_io_rate, wrk(same_io_server.port, bodies, script))
                minimal_kvsp_rate = max(
                    minimal_kvsp_rate, wrk(minimal_kvsp_server.port, bodies, script)
                )

    redis = asyncio.run(redis_part(args.records, requests))
    results = {
        "records": args.records,
        "prompt_blocks": PROMPT_BLOCKS,
        "in_process_lookups_per_s": round(in_process_rate),
        "http_lookups_per_s": round(http_rate),
        "minimal_uvicorn_requests_per_s": round(minimal_rate),
        "http_ratio": round(http_rate / minimal_rate, 3),
        "same_io_requests_per_s": round(same_io_rate),
        "same_io_ratio_to_minimal": round(same_io_rate / minimal_rate, 3),
        "http_ratio_to_same_io": round(http_rate / same_io_rate, 3),
        "minimal_kvsp_serving_requests_per_s": round(minimal_kvsp_rate),
        **redis,
        "memory_octets_per_record": round(per_record),
        "memory_ratio": round(per_record / MEMORY_LIMIT, 3),
        "memory_octets_per_record_with_30_layer_digests": round(per_record_digests),
        "memory_ratio_with_30_layer_digests": round(per_record_digests / MEMORY_LIMIT_DIGESTS, 3),
    }
    meets = (
        results["http_ratio"] >= 0.5
        and results["redis_ratio"] >= 0.5
        and per_record <= MEMORY_LIMIT
        and per_record_digests <= MEMORY_LIMIT_DIGESTS
    )
    print(
        json.dumps(
            {
                "benchmark": "index_lookup",
                "limits": {
                    "http": "minimal app on uvicorn as it comes, same wrk load (>= 0.5)",
                    "redis": "raw redis-py pipeline on the same keys (>= 0.5)",
                    "memory": f"<= {MEMORY_LIMIT} octets per record, "
                    f"<= {MEMORY_LIMIT_DIGESTS} with 30 layer digests",
                },
                "meets_target": meets,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
