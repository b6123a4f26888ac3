"""Ingest over real sockets into a real IS: vLLM's own ``ZmqEventPublisher`` (the code an
unmodified ``vllm serve`` publishes with) stores and removes blocks, then restarts; a stand-in
publisher skips batches its replay buffer still has, then ones it no longer has."""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

from kvsp.auth import Principals
from kvsp.core.clock import SystemClock
from kvsp.core.records import LookupRequest
from kvsp.index.app import create_app as create_index_app
from kvsp.index.client import IndexClient
from kvsp.index.rules import IndexLimits
from kvsp.index.service import IndexService
from kvsp.index.stores import MemoryReplicaStore
from kvsp.kvevents.ingest import PodEndpoint, PodStream
from kvsp.kvevents.pods import PodSource
from tests.index.factories import COMPAT
from tests.kvevents.test_pods import ACME, keys_of
from tests.principals import principal
from tests.servers import serving

pytestmark = pytest.mark.anyio
POD = "http://pod.test/"
#: a second ingest's name for the same pod's blocks
LATE = "http://late.test/"
TOKENS = list(range(700, 764))
encode = msgspec.msgpack.Encoder().encode


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    return BlockStored(
        block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=16,
        lora_id=None, medium="GPU", lora_name=None,
    )  # fmt: skip


class Env:
    def __init__(self, folder: Path, index: IndexClient, reader: IndexClient) -> None:
        self.folder = folder
        self.index = index
        self.reader = reader
        self.endpoint = f"ipc://{folder}/pub"
        self.replay = f"ipc://{folder}/replay"
        self.stream = self.stream_for(POD)

    def stream_for(self, holder: str) -> PodStream:
        """A stream of the pod's events that names ``holder`` in the records it writes."""
        source = PodSource(holder, COMPAT, 16, 30, ACME, {}, ttl_ms=60_000)
        pod = PodEndpoint("pod-a", source, self.endpoint, self.replay)
        return PodStream(pod, self.index, zmq.asyncio.Context.instance())

    async def held(self, tokens: list[int]) -> list[tuple[str, tuple[str, ...]]]:
        """Per block of ``tokens``: the pod's record's tiers, as the IS answers a lookup."""
        keys = tuple(keys_of("acme", tokens))
        answer = await self.reader.lookup(
            LookupRequest(scope_id=ACME.scope_id, compat_id=COMPAT, block_keys=keys)
        )
        return [
            (r.holder, tuple(x.tier for x in r.residency))
            for block in answer.replicas
            for r in block
        ]

    async def until(self, check: Callable[[], Any], timeout_s: float = 10) -> None:
        async with asyncio.timeout(timeout_s):
            while not await check():
                await asyncio.sleep(0.05)


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    principals = Principals.parse(
        principal("ingest", ["ingest"], [POD, LATE]) + principal("reader", ["client"])
    )
    service = IndexService(MemoryReplicaStore(SystemClock(), IndexLimits()))
    async with serving(create_index_app(service, principals)) as base:
        index, reader = IndexClient(base, "ingest"), IndexClient(base, "reader")
        with tempfile.TemporaryDirectory() as folder:
            e = Env(Path(folder), index, reader)
            task = asyncio.create_task(e.stream.run())
            try:
                yield e
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await index.aclose()
                await reader.aclose()


async def test_vllms_own_publisher_stores_removes_and_restarts(env: Env) -> None:
    publisher = ZmqEventPublisher(0, endpoint=env.endpoint, replay_endpoint=env.replay)
    try:
        await asyncio.sleep(0.5)  # the SUB socket joins
        publisher.publish(
            KVEventBatch(ts=time.time(), events=[stored([11, 12], None, TOKENS[:32])])
        )
        publisher.publish(KVEventBatch(ts=time.time(), events=[stored([13], 12, TOKENS[32:48])]))

        async def three() -> bool:
            return len(await env.held(TOKENS)) == 3

        await env.until(three)
        assert await env.held(TOKENS) == [(POD, ("device",))] * 3
        publisher.publish(KVEventBatch(ts=time.time(), events=[BlockRemoved([13], "GPU")]))

        async def two() -> bool:
            return len(await env.held(TOKENS)) == 2

        await env.until(two)
    finally:
        publisher.shutdown()
    # the pod restarts: its sequence starts again, and nothing it held before is kept
    publisher = ZmqEventPublisher(0, endpoint=env.endpoint, replay_endpoint=env.replay)
    try:
        await asyncio.sleep(0.5)
        publisher.publish(KVEventBatch(ts=time.time(), events=[stored([21], None, TOKENS[:16])]))

        async def restarted() -> bool:
            return env.stream.resets == 1 and len(await env.held(TOKENS)) == 1

        await env.until(restarted)
    finally:
        publisher.shutdown()


async def test_an_ingest_started_late_reads_the_replay_buffer_at_once(env: Env) -> None:
    publisher = ZmqEventPublisher(0, endpoint=env.endpoint, replay_endpoint=env.replay)
    try:
        await asyncio.sleep(0.5)
        publisher.publish(
            KVEventBatch(ts=time.time(), events=[stored([11, 12], None, TOKENS[:32])])
        )

        async def two() -> bool:
            return len(await env.held(TOKENS)) == 2

        await env.until(two)
        # the pod goes idle; an ingest started now learns its blocks without another batch
        late = env.stream_for(LATE)
        task = asyncio.create_task(late.run())
        try:

            async def both() -> bool:
                return len(await env.held(TOKENS)) == 4

            await env.until(both)
            assert {holder for holder, _ in await env.held(TOKENS)} == {POD, LATE}
            # the live stream goes on from the buffer's last batch, none applied twice
            publisher.publish(
                KVEventBatch(ts=time.time(), events=[stored([13], 12, TOKENS[32:48])])
            )

            async def three_each() -> bool:
                return len(await env.held(TOKENS)) == 6

            await env.until(three_each)
            assert (late.batches, late.resets) == (2, 0)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    finally:
        publisher.shutdown()


class GapPublisher:
    """A publisher whose sequence numbers the test chooses, with a replay buffer it keeps."""

    def __init__(self, env: Env) -> None:
        context = zmq.Context.instance()
        self.pub: zmq.Socket[bytes] = context.socket(zmq.PUB)
        self.pub.bind(env.endpoint)
        self.router: zmq.Socket[bytes] = context.socket(zmq.ROUTER)
        self.router.bind(env.replay)
        self.buffer: dict[int, bytes] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.answer, daemon=True)
        self.thread.start()

    def answer(self) -> None:
        while not self.stop.is_set():
            if self.router.poll(50):
                peer, _, start = self.router.recv_multipart()
                for seq in sorted(self.buffer):
                    if seq >= int.from_bytes(start, "big"):
                        self.router.send_multipart(
                            (peer, b"", b"", seq.to_bytes(8, "big"), self.buffer[seq])
                        )
                self.router.send_multipart(
                    (peer, b"", b"", (-1).to_bytes(8, "big", signed=True), b"")
                )

    def batch(self, seq: int, *events: Any, send: bool = True) -> None:
        payload = encode(KVEventBatch(ts=time.time(), events=list(events)))
        self.buffer[seq] = payload
        if send:
            self.pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.pub.close(linger=0)
        self.router.close(linger=0)


async def test_a_gap_is_replayed_and_one_the_buffer_lost_drops_the_records(env: Env) -> None:
    publisher = GapPublisher(env)
    try:
        await asyncio.sleep(0.5)
        publisher.batch(0, stored([1], None, TOKENS[:16]))
        publisher.batch(1, stored([2], 1, TOKENS[16:32]), send=False)  # lost on the way
        publisher.batch(2, stored([3], 2, TOKENS[32:48]))

        async def three() -> bool:
            return len(await env.held(TOKENS)) == 3

        await env.until(three)  # batch 1 came from the replay buffer
        assert env.stream.resets == 0
        # batches 3 and 4 are lost and the buffer no longer has them: one of them may have
        # removed a block, so nothing from before can be trusted
        publisher.buffer.clear()
        publisher.batch(5, stored([9], None, TOKENS[:16]))

        async def rebuilt() -> bool:
            return env.stream.resets == 1 and len(await env.held(TOKENS)) == 1

        await env.until(rebuilt)
    finally:
        publisher.close()
