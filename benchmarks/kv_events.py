"""vLLM-format KV events: what publishing them costs an instance, how fast a buffer replays, and
how fast ``kvsp index ingest`` reads them. Prints one JSON line.

- ``ttft``: two reference instances in this process, one publishing KV events and one not,
  serve the same fresh 512-token prompts in interleaved rounds; the ratio of their median times
  to the first released token (target <= 1.02), and the events the publishing one sent per
  second while it served;
- ``replay``: 10,000 batches of one block each asked for from sequence 0 over the ROUTER
  socket, against the same frames sent live over PUB/SUB;
- ``ingest``: 20,000 vLLM ``BlockStored`` batches (one 16-token block each, one chain), as
  ``kvsp index ingest`` takes them (decode, Block Keys from the tokens, Replica Records), against
  raw msgpack decoding of the same frames (target >= 0.5) and against the bound that stops it:
  deriving the same Block Keys alone (an HMAC-SHA-256 per block, which decoding does not do);
  and end to end, from vLLM's own ``ZmqEventPublisher`` through a ``PodStream`` into a running
  IS over HTTP.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec
import zmq
import zmq.asyncio
from tests.instance.test_service import CONTROLLER, SCOPE_KEY, Controller, released
from tests.principals import principal
from tests.servers import free_port, serving

from _timing import best_times
from kvsp.auth import Principals
from kvsp.core.clock import SystemClock
from kvsp.core.keys import block_keys
from kvsp.core.records import Sampler
from kvsp.index.app import create_app as create_index_app
from kvsp.index.client import IndexClient
from kvsp.index.rules import IndexLimits
from kvsp.index.service import IndexService
from kvsp.index.stores import MemoryReplicaStore
from kvsp.instance.config import InstanceConfig
from kvsp.instance.service import InstanceService
from kvsp.kvevents.ingest import PodEndpoint, PodStream
from kvsp.kvevents.pods import PodChanges, PodIndex, PodSource
from kvsp.kvevents.publisher import KvEventPublisher, PublisherConfig
from kvsp.kvevents.wire import BlockStored, EventBatch, decode_batch, encode_batch
from kvsp.model import install
from kvsp.tenants import Tenants

GREEDY = Sampler(method="greedy", deterministic=True)
ROUNDS = 11
PROMPT = 512
REPLAY = 10_000
INGEST = 20_000


async def ttft(files: Any) -> dict[str, float]:
    controller = Controller()
    controller.limit = None
    async with serving(controller.app) as base:
        tenants = Tenants.parse(
            f'[tenants.acme]\nscope_key = "{SCOPE_KEY}"\ncompat_ids = ["{files.compat_id.hex()}"]\n'
        )

        def config(events: PublisherConfig | None) -> InstanceConfig:
            return InstanceConfig(
                url=f"http://127.0.0.1:{free_port()}/kvsp/", tenants=tenants,
                controller_url=base, g1_blocks=512, threads=1, kv_events=events,
            )  # fmt: skip

        on = InstanceService(
            config(PublisherConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint=None)), files
        )
        off = InstanceService(config(None), files)
        for service in (on, off):
            await service.start()
        subscriber: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"")
        assert on.kv_events is not None
        subscriber.connect(on.kv_events.publisher.endpoint)  # someone listens, as in production
        times: dict[str, list[float]] = {"on": [], "off": []}
        started = time.perf_counter()
        events_before = on.kv_events.publisher.events
        try:
            for r in range(ROUNDS):
                order = (("on", on), ("off", off))
                for name, service in order if r % 2 else order[::-1]:
                    prompt = [(r * 7919 + i * 31 + len(name)) % 40_000 + 100 for i in range(PROMPT)]
                    t0 = time.perf_counter()
                    session = await service.generate(CONTROLLER, "acme", prompt, GREEDY, 1)
                    await released(service, session)
                    times[name].append(time.perf_counter() - t0)
        finally:
            elapsed = time.perf_counter() - started
            sent = on.kv_events.publisher.events - events_before
            subscriber.close(linger=0)
            for service in (on, off):
                await service.close()
    on_s, off_s = statistics.median(times["on"]), statistics.median(times["off"])
    return {
        "ttft_on_s": round(on_s, 4),
        "ttft_off_s": round(off_s, 4),
        "ttft_on_over_off": round(on_s / off_s, 4),
        "events_per_s_under_load": round(sent / elapsed, 1),
    }


def block_batches(count: int) -> list[bytes]:
    out = []
    parent = None
    for i in range(count):
        tokens = [(i * 16 + t) % 40_000 for t in range(16)]
        event = BlockStored([i + 1], parent, tokens, 16, None, "GPU", None)
        out.append(encode_batch(EventBatch(time.time(), [event])))
        parent = i + 1
    return out


def replay(frames: list[bytes]) -> dict[str, float]:
    """The buffer's replay of every batch against the same frames live over PUB/SUB."""
    publisher = KvEventPublisher(
        PublisherConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
                        heartbeat_s=0, buffer_batches=len(frames), queue_batches=len(frames))
    )  # fmt: skip
    context = zmq.Context.instance()
    for frame in frames:
        publisher.publish(decode_batch(frame).events)
    while publisher.batches < len(frames):
        time.sleep(0.01)
    dealer: zmq.Socket[bytes] = context.socket(zmq.DEALER)
    dealer.set_hwm(len(frames) + 2)
    dealer.connect(publisher.replay_endpoint or "")

    def replayed() -> None:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        n = 0
        while True:
            parts = dealer.recv_multipart()
            if parts[2] == (-1).to_bytes(8, "big", signed=True):
                break
            n += 1
        assert n == len(frames)

    pub: zmq.Socket[bytes] = context.socket(zmq.PUB)
    pub.set_hwm(len(frames) + 1)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub: zmq.Socket[bytes] = context.socket(zmq.SUB)
    sub.set_hwm(len(frames) + 1)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.3)

    def live() -> None:
        for seq, frame in enumerate(frames):
            pub.send_multipart((b"", seq.to_bytes(8, "big"), frame))
        for _ in frames:
            sub.recv_multipart()

    best = best_times({"replay": replayed, "live": live}, 5)
    for socket in (dealer, pub, sub):
        socket.close(linger=0)
    publisher.close()
    return {
        "replay_10k_s": round(best["replay"], 4),
        "replay_over_live_rate": round(best["live"] / best["replay"], 3),
    }


def ingest_in_process(frames: list[bytes], source: PodSource) -> dict[str, float]:
    decoder = msgspec.msgpack.Decoder()

    def raw() -> None:
        for frame in frames:
            decoder.decode(frame)

    def ingest() -> None:
        pod, changes = PodIndex(source), PodChanges()
        for frame in frames:
            pod.apply(decode_batch(frame), changes)
        for block, tiers in changes.put.items():
            pod.record_json(block, tiers)

    tokens = [t for frame in frames for e in decode_batch(frame).events for t in e.token_ids]
    assert source.tenant is not None
    key, compat = source.tenant.scope_key, bytes.fromhex(source.compat_id)

    def keys() -> None:  # the bound: the HMAC chain over the same tokens, nothing else
        block_keys(key, compat, tokens, 16)  # type: ignore[arg-type]

    best = best_times({"raw": raw, "ingest": ingest, "keys": keys}, 5)
    return {
        "raw_decode_blocks_per_s": round(len(frames) / best["raw"]),
        "block_keys_per_s": round(len(frames) / best["keys"]),
        "ingest_blocks_per_s": round(len(frames) / best["ingest"]),
        "ingest_over_raw_decode": round(best["raw"] / best["ingest"], 3),
        "ingest_over_block_keys": round(best["keys"] / best["ingest"], 3),
    }


async def ingest_end_to_end(frames: list[bytes], source: PodSource) -> dict[str, float]:
    """vLLM's own publisher -> ZMQ -> PodStream -> a running IS, until every record is in."""
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    vllm_batches = [msgspec.msgpack.Decoder(KVEventBatch).decode(f) for f in frames]
    principals = Principals.parse(principal("ingest", ["ingest"], [source.url]))
    service = IndexService(MemoryReplicaStore(SystemClock(), IndexLimits()))
    async with serving(create_index_app(service, principals)) as base:
        with tempfile.TemporaryDirectory() as folder:
            endpoint, replay = f"ipc://{folder}/pub", f"ipc://{folder}/replay"
            pod = PodEndpoint("bench", source, endpoint, replay)
            index = IndexClient(base, "ingest")
            stream = PodStream(pod, index, zmq.asyncio.Context.instance())
            task = asyncio.create_task(stream.run())
            publisher = ZmqEventPublisher(
                0, endpoint=endpoint, replay_endpoint=replay, buffer_steps=len(frames),
                max_queue_size=len(frames),
            )  # fmt: skip
            await asyncio.sleep(0.5)
            start = time.perf_counter()
            for batch in vllm_batches:
                publisher.publish(batch)
            async with asyncio.timeout(300):
                while sum((await service.store.counts_by_scope()).values()) < len(frames):
                    await asyncio.sleep(0.01)
            elapsed = time.perf_counter() - start
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            publisher.shutdown()
            await index.aclose()
    return {"ingest_end_to_end_blocks_per_s": round(len(frames) / elapsed)}


def main() -> None:
    files = install()
    figures: dict[str, Any] = {"benchmark": "kv_events"}
    figures.update(asyncio.run(ttft(files)))
    figures.update(replay(block_batches(REPLAY)))
    tenants = Tenants.parse(
        f'[tenants.acme]\nscope_key = "{SCOPE_KEY}"\ncompat_ids = ["{files.compat_id.hex()}"]\n'
    )
    source = PodSource(
        "http://pod.bench/", files.compat_id.hex(), 16, files.descriptor.geometry.layers,
        tenants.get("acme"), ttl_ms=600_000,
    )  # fmt: skip
    frames = block_batches(INGEST)
    figures.update(ingest_in_process(frames, source))
    figures.update(asyncio.run(ingest_end_to_end(frames, source)))
    figures["targets"] = {"ttft_on_over_off": "<= 1.02", "ingest_over_raw_decode": ">= 0.5"}
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
