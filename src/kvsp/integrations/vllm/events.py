"""vLLM's KV events, read from its ZMQ publisher into ``G1Pages``.

vLLM publishes each engine step's ``KVEventBatch`` (msgpack) as a three-part message: topic,
an 8-octet sequence number, the batch. This thread subscribes and applies ``BlockStored``,
``BlockRemoved`` and ``AllBlocksCleared``. A gap in the sequence (the publisher's high-water
mark dropped batches) is logged: the pages of the lost batches stay as last known until vLLM
reports them again. The subscriber only reads; it never slows vLLM down.
"""

from __future__ import annotations

import logging
import threading

import msgspec
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from kvsp.integrations.vllm.g1 import G1Pages

__all__ = ["KvEventSubscriber", "subscriber_endpoint"]

log = logging.getLogger("kvsp.vllm.events")
_POLL_MS = 200


def subscriber_endpoint(publisher: str) -> str:
    """Where to connect for a publisher that binds ``publisher`` (a wildcard host is this one)."""
    return publisher.replace("*", "127.0.0.1")


class KvEventSubscriber:
    def __init__(self, endpoint: str, pages: G1Pages, topic: str = "") -> None:
        self.pages = pages
        self._decode = msgspec.msgpack.Decoder(KVEventBatch)
        self._socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._socket.connect(subscriber_endpoint(endpoint))
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvsp-kv-events", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(5)

    def _run(self) -> None:
        last: int | None = None
        try:
            while not self._stopped.is_set():
                if not self._socket.poll(_POLL_MS):
                    continue
                parts = self._socket.recv_multipart()
                if len(parts) != 3:
                    continue
                seq = int.from_bytes(parts[1], "big")
                if last is not None and seq != last + 1:
                    log.warning("vLLM KV events %d to %d were lost", last + 1, seq - 1)
                last = seq
                try:
                    batch = self._decode.decode(parts[2])
                except msgspec.DecodeError as exc:
                    log.warning("a vLLM KV event batch did not decode: %s", exc)
                    continue
                self.apply(batch)
        finally:
            self._socket.close(linger=0)

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.pages.stored(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.pages.removed(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.pages.cleared()
