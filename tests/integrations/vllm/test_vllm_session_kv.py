"""Session-aware KV on the vLLM-backed instance, in real processes: the SessionPrefixIndex sees
vLLM's own pages (G1, from vLLM's KV events) beside the embedded holder's copies (G2), and every
hint says what it reached: kvsp's copies, or not vLLM's pages (``engine-g1``); a prefetch with a
destination copies the session's blocks there; Dynamo's ``kv.fetch`` is refused by version."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.instance.engine import Engine
from kvsp.model import ModelFiles
from tests.integration.instances import Cluster, eventually, generate
from tests.integration.test_session_hints_processes import events, hint
from tests.integrations.vllm.test_vllm_processes import LONG, greedy
from tests.servers import running

pytestmark = [pytest.mark.anyio, pytest.mark.slow]


async def local_tiers(base: str) -> list[tuple[tuple[str, ...], int]]:
    """How many blocks the instance's event log has in each set of local tiers now."""
    last: dict[str, tuple[str, ...]] = {}
    for event in (await events(base))["events"]:
        if event["kind"] == "residency":
            last[event["block_key"]] = tuple(event["tiers"])
        elif event["kind"] == "eviction":
            last.pop(event["block_key"], None)
    return sorted(Counter(last.values()).items())


class KvEvents:
    """What an instance's KV events say it holds, per medium, decoded by vLLM's own classes."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)
        self.decode = msgspec.msgpack.Decoder(KVEventBatch)
        self.held: dict[Any, set[str]] = {}

    async def media(self) -> dict[str, int]:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        while self.socket.poll(0):
            for event in self.decode.decode(self.socket.recv_multipart()[2]).events:
                if isinstance(event, AllBlocksCleared):
                    self.held.clear()
                elif isinstance(event, BlockStored | BlockRemoved):
                    for h in event.block_hashes:
                        media = self.held.setdefault(h, set())
                        if isinstance(event, BlockStored):
                            media.add(event.medium or "GPU")
                        else:
                            media.discard(event.medium or "GPU")
        return dict(Counter(m for media in self.held.values() for m in media))

    def close(self) -> None:
        self.socket.close(linger=0)


async def test_hints_on_vllm_resolve_against_its_pages_and_say_what_they_reached(
    tmp_path: Path, model_files: ModelFiles, engine: Engine
) -> None:
    cluster = Cluster(tmp_path, model_files.compat_id.hex())
    kv_events = f"ipc://{tmp_path}/a-kv-events"
    a = cluster.instance("--engine", "vllm", "--session-index", "--kv-events", kv_events)
    b = cluster.instance()
    session = str(uuid.uuid4())
    me: dict[str, Any] = {"target": {"session": session}}
    expected = greedy(engine, LONG, 24)
    published = KvEvents(kv_events)
    with running(cluster.index, cluster.holder, a, b):
        first = await generate(a.base_url, LONG, 24, session=session)
        assert first["tokens"] == expected
        # 323 tokens computed: 20 blocks, each saved to G2; vLLM caches whole pages of 128
        # tokens, so the first 16 are in its pages too (its BlockStored events say so)
        await eventually(lambda: local_tiers(a.base_url), [(("g1", "g2"), 16), (("g2",), 4)])
        # and the instance's own vLLM-format KV events say the same: 16 blocks in GPU (vLLM's
        # pages), 20 in CPU (the embedded holder's G2)
        await eventually(published.media, {"GPU": 16, "CPU": 20})
        published.close()

        retain, pin, prefetch, demote = await hint(
            a.base_url,
            ("kv.retain", {**me, "ttl_ms": 60_000, "priority": 5}),
            ("kv.pin", {**me, "ttl_ms": 60_000}),
            ("kv.prefetch", me),
            ("kv.demote", me),
        )
        # kvsp's copies of all 20 are retained, pinned, and verified in G2; vLLM's pages follow
        # vLLM's own eviction, which the outcome says
        for out in (retain, pin, demote):
            assert (out["outcome"], out["code"], out["blocks"]) == ("clipped", "engine-g1", 20)
            assert "16 target blocks" in out["reason"]
            assert "missing" not in out
        # prefetch: 16 are in vLLM's pages already; 4 are in G2 only, which vLLM loads only
        # for a request
        assert (prefetch["outcome"], prefetch["code"], prefetch["blocks"]) == (
            "clipped",
            "engine-g1",
            16,
        )
        assert "4 target blocks" in prefetch["reason"]

        # a prefetch toward the instance that will serve the session: copied there, used there
        [toward] = await hint(a.base_url, ("kv.prefetch", {**me, "destination": b.base_url}))
        assert (toward["outcome"], toward["blocks"]) == ("accepted", 20)
        on_b = await generate(b.base_url, LONG, 24)
        assert on_b["tokens"] == expected
        assert "remote" not in on_b["summary"]["cached"]
        assert sum(on_b["summary"]["cached"].values()) == 288  # every matchable block, local

        # Dynamo's typed fetch, in its own form: refused by name and version, not an error
        dynamo = {"source_control_endpoint": "tcp://127.0.0.1:9", "block_hashes": [7, 8],
                  "mode": "copy"}  # fmt: skip
        [fetch] = await hint(a.base_url, ("kv.fetch", dynamo))
        assert (fetch["outcome"], fetch["code"]) == ("rejected", "not-implemented")
        assert "kv.fetch version 1.0" in fetch["reason"]

        # the session's next turn is served from vLLM's own pages
        again = await generate(a.base_url, LONG, 8, session=session)
        assert again["tokens"] == expected[:8]
        assert again["summary"]["cached"].get("g1", 0) >= 256
        async with httpx.AsyncClient() as http:
            ended = (await http.delete(f"{a.base_url}sessions/{session}")).json()
        assert ended["pins_released"] == 20
    for service in (a, b):
        assert service.log.count(b"Traceback") == 0
