"""The reference instance's vLLM-format KV events, read by a ZMQ subscriber and decoded with the
pinned vLLM's own event classes: ``AllBlocksCleared`` first, then each block the pool holds at
each medium with its tokens, parent and Block Key hash; removals when G1 lets blocks go;
replay of every batch from a sequence number; heartbeats while idle."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from kvsp.core.records import Sampler
from kvsp.instance.config import InstanceConfig
from kvsp.instance.service import InstanceService
from kvsp.kvevents.publisher import PublisherConfig
from kvsp.kvevents.wire import external_hash
from kvsp.model import ModelFiles
from kvsp.tenants import Tenants
from tests.instance.test_service import CONTROLLER, PROMPT, SCOPE_KEY, Controller, released
from tests.servers import free_port, serving

pytestmark = pytest.mark.anyio
GREEDY = Sampler(method="greedy", deterministic=True)
decode = msgspec.msgpack.Decoder(KVEventBatch)


class Subscriber:
    """Every (topic, seq, batch) the instance publishes, decoded by vLLM's decoder."""

    def __init__(self, endpoint: str) -> None:
        self.socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)
        self.got: list[tuple[str, int, KVEventBatch]] = []

    def drain(self) -> list[tuple[str, int, KVEventBatch]]:
        while self.socket.poll(50):
            topic, seq, payload = self.socket.recv_multipart()
            self.got.append((topic.decode(), int.from_bytes(seq, "big"), decode.decode(payload)))
        return self.got

    def events(self) -> list[Any]:
        return [e for _, _, batch in self.drain() for e in batch.events]


@pytest.fixture
async def instance(model_files: ModelFiles) -> AsyncIterator[tuple[InstanceService, Subscriber]]:
    controller = Controller()
    controller.limit = None
    async with serving(controller.app) as base:
        compat = model_files.compat_id.hex()
        tenants = Tenants.parse(
            f'[tenants.acme]\nscope_key = "{SCOPE_KEY}"\ncompat_ids = ["{compat}"]\n'
        )
        pub, replay = free_port(), free_port()
        config = InstanceConfig(
            url=f"http://127.0.0.1:{free_port()}/kvsp/",
            tenants=tenants,
            controller_url=base,
            g1_blocks=4,
            threads=2,
            kv_events=PublisherConfig(
                endpoint=f"tcp://127.0.0.1:{pub}",
                replay_endpoint=f"tcp://127.0.0.1:{replay}",
                topic="kvsp",
                heartbeat_s=0.2,
            ),
        )
        # subscribe before the instance starts: its first batch is AllBlocksCleared
        subscriber = Subscriber(f"tcp://127.0.0.1:{pub}")
        service = InstanceService(config, model_files)
        await service.start()
        try:
            yield service, subscriber
        finally:
            await service.close()
            subscriber.socket.close(linger=0)


async def until_events(subscriber: Subscriber, condition: Any, timeout_s: float = 30) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition(subscriber.events()):
            await asyncio.sleep(0.05)


async def test_blocks_are_published_with_their_tokens_parents_and_media(
    instance: tuple[InstanceService, Subscriber],
) -> None:
    service, subscriber = instance
    await asyncio.sleep(0.5)  # the SUB socket joins (ZMQ drops what is sent before)
    session = await service.generate(CONTROLLER, "acme", PROMPT * 2, GREEDY, 4)
    await released(service, session)

    def stored_gpu(events: list[Any]) -> list[tuple[Any, Any, list[int]]]:
        out = []
        for e in events:
            if isinstance(e, BlockStored) and e.medium == "GPU":
                for i, h in enumerate(e.block_hashes):
                    parent = e.parent_block_hash if i == 0 else e.block_hashes[i - 1]
                    out.append((h, parent, e.token_ids[16 * i : 16 * (i + 1)]))
        return out

    await until_events(subscriber, lambda events: len(stored_gpu(events)) >= 4)
    keys = [bytes.fromhex(k) for k in session.prompt_blocks]
    assert len(keys) == 4
    hashes = [external_hash(k) for k in keys]
    blocks = stored_gpu(subscriber.events())[:4]
    assert [b[0] for b in blocks] == hashes
    assert [b[1] for b in blocks] == [None, *hashes[:3]]
    assert [b[2] for b in blocks] == [PROMPT[:16], PROMPT[16:], PROMPT[:16], PROMPT[16:]]
    topics = {topic for topic, _, _ in subscriber.drain()}
    assert topics == {"kvsp"}
    # sequence numbers start at the epoch: a restarted instance's are higher than its last
    assert subscriber.drain()[0][1] >= service.epoch << 20
    first = next(e for e in subscriber.events() if isinstance(e, BlockStored))
    assert first.block_size == 16
    assert first.extra_keys is not None
    assert first.extra_keys[0] == (session.tenant.scope_id,)
    assert first.session_id == session.session

    # G1 holds 4 blocks: a second prompt demotes the first one's blocks to G2 (CPU)
    other = await service.generate(CONTROLLER, "acme", list(range(1000, 1064)), GREEDY, 2)
    await released(service, other)
    await until_events(
        subscriber,
        lambda events: any(
            isinstance(e, BlockRemoved) and e.medium == "GPU" and hashes[0] in e.block_hashes
            for e in events
        ),
    )
    cpu = {
        h for e in subscriber.events()
        if isinstance(e, BlockStored) and e.medium == "CPU" for h in e.block_hashes
    }  # fmt: skip
    assert hashes[0] in cpu


async def test_the_first_batch_clears_and_replay_returns_every_batch_in_order(
    instance: tuple[InstanceService, Subscriber],
) -> None:
    service, subscriber = instance
    endpoints = service.kv_events_endpoints()
    assert endpoints is not None
    assert endpoints["replay_endpoint"] is not None
    session = await service.generate(CONTROLLER, "acme", PROMPT, GREEDY, 2)
    await released(service, session)
    await asyncio.sleep(0.6)  # heartbeats: empty batches while nothing changes
    live = subscriber.drain()
    assert any(not batch.events for _, _, batch in live)
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoints["replay_endpoint"])
    try:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and dealer.poll(2000):
            _, _topic, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            replayed.append((int.from_bytes(seq, "big"), decode.decode(payload)))
    finally:
        dealer.close(linger=0)
    seqs = [seq for seq, _ in replayed]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # from the first, none missing
    assert seqs[0] == service.epoch << 20
    assert isinstance(replayed[0][1].events[0], AllBlocksCleared)
    # what the live subscriber saw is what the buffer replays, batch for batch
    by_seq = dict(replayed)
    for _, seq, batch in live:
        if seq in by_seq:
            assert by_seq[seq].events == batch.events
