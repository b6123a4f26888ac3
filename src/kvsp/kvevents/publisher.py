"""KV events published over ZMQ as vLLM publishes them: a PUB socket, a ROUTER socket for
replay from a sequence number, a bounded replay buffer, and an idle heartbeat.

One thread owns both sockets (ZMQ sockets are not thread-safe): ``publish`` only puts the
events in a bounded queue, so the event loop that produces them never encodes or sends.
Sequence numbers count every batch, heartbeats included, so a subscriber that misses one sees
the gap and asks for a replay. An instance starts counting at its epoch shifted left by 20 bits
(``epoch_seq``): a restarted instance's numbers are higher than any its earlier process sent,
so a subscriber that kept the old stream sees a gap, asks for a replay and gets the new
process's first batch, ``AllBlocksCleared``, instead of taking the new numbers for old ones and
keeping what the dead process held. When the queue is full, ``publish`` says so (False) and the
caller restates its state (``KvEventFeed.snapshot``, which starts with ``AllBlocksCleared``)
rather than leave a gap that no replay could fill. The buffer keeps the latest batches up to a
count and an octet bound; a replay request that is not one 8-octet sequence number is ignored
(and logged once per peer, escaped). CURVE encryption and authentication apply to both
sockets when a server secret key is given (docs/decisions/0021).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import zmq
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from kvsp.kvevents.feed import KvEventFeed
from kvsp.kvevents.wire import END_SEQ, EventBatch, KvEvent, encode_batch, seq_octets

__all__ = [
    "KvEventPublisher",
    "PublishedFeed",
    "PublisherConfig",
    "PublisherMetrics",
    "epoch_seq",
]

log = logging.getLogger("kvsp.kvevents")
_POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class PublisherConfig:
    #: where the PUB socket binds (port 0: any free port; ``endpoint`` tells which)
    endpoint: str = "tcp://127.0.0.1:5557"
    #: where the ROUTER socket for replays binds (None: no replay)
    replay_endpoint: str | None = "tcp://127.0.0.1:5558"
    topic: str = ""
    #: the first batch's sequence number (an instance starts at its epoch, shifted: see above)
    first_seq: int = 0
    #: batches kept for replay, and the octets they may take
    buffer_batches: int = 10_000
    buffer_octets: int = 64 << 20
    #: batches waiting for the publisher thread before ``publish`` refuses more
    queue_batches: int = 10_000
    #: an empty batch after this long without one (0: none)
    heartbeat_s: float = 1.0
    #: ZMQ's send high-water mark per subscriber
    hwm: int = 100_000
    data_parallel_rank: int | None = None
    #: Z85 CURVE server secret key (None: plain TCP, for loopback and trusted networks)
    curve_secret_key: str | None = None


def epoch_seq(epoch: int) -> int:
    """The first sequence number of a publisher started at ``epoch`` (milliseconds): above
    every number an earlier process could have reached (a million batches per millisecond)."""
    return epoch << 20


class KvEventPublisher:
    def __init__(self, config: PublisherConfig) -> None:
        if config.buffer_batches < 1 or config.queue_batches < 1 or config.buffer_octets < 1:
            raise ValueError("the event buffer and queue need room for at least one batch")
        self.config = config
        self.topic = config.topic
        self._topic = config.topic.encode()
        self._queue: queue.Queue[list[KvEvent] | None] = queue.Queue(config.queue_batches)
        self._buffer: deque[tuple[int, bytes]] = deque()
        self._buffered_octets = 0
        self._seq = config.first_seq
        self.batches = 0
        self.events = 0
        self.refused = 0
        self.replays = 0
        self._warned: set[bytes] = set()
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub: zmq.Socket[bytes] = context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self.endpoint = self._bind(self._pub, config.endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        self.replay_endpoint: str | None = None
        if config.replay_endpoint is not None:
            self._replay = context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.MAXMSGSIZE, 64)  # a request is 8 octets
            # a whole buffer's replay fits in one peer's queue: a ROUTER drops what does not
            self._replay.set_hwm(config.buffer_batches + 2)
            self.replay_endpoint = self._bind(self._replay, config.replay_endpoint)
        self._thread = threading.Thread(target=self._run, name="kvsp-kv-events", daemon=True)
        self._thread.start()

    def _bind(self, socket: zmq.Socket[bytes], endpoint: str) -> str:
        socket.setsockopt(zmq.LINGER, 0)
        if self.config.curve_secret_key is not None:
            socket.curve_server = True
            socket.curve_secretkey = self.config.curve_secret_key.encode()
        socket.bind(endpoint)
        bound: bytes = socket.getsockopt(zmq.LAST_ENDPOINT)  # type: ignore[assignment]
        return bound.decode()

    def publish(self, events: list[KvEvent]) -> bool:
        """Queue one batch; False when the queue is full (the batch is not sent)."""
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.refused += 1
            return False
        return True

    def close(self) -> None:
        """Send what is queued, then close both sockets."""
        self._queue.put(None)
        self._thread.join(5)

    def _run(self) -> None:
        heartbeat = self.config.heartbeat_s
        last = time.monotonic()
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._answer_replay(self._replay)
                try:
                    events = self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    if heartbeat and time.monotonic() - last >= heartbeat:
                        self._send([])
                        last = time.monotonic()
                    continue
                if events is None:
                    return
                self._send(events)
                last = time.monotonic()
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _send(self, events: list[KvEvent]) -> None:
        batch = EventBatch(time.time(), events, self.config.data_parallel_rank)
        payload = encode_batch(batch)
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self._topic, seq_octets(seq), payload))
        self.batches += 1
        self.events += len(events)
        self._buffer.append((seq, payload))
        self._buffered_octets += len(payload)
        while len(self._buffer) > 1 and (
            len(self._buffer) > self.config.buffer_batches
            or self._buffered_octets > self.config.buffer_octets
        ):
            self._buffered_octets -= len(self._buffer.popleft()[1])

    def _answer_replay(self, replay: zmq.Socket[bytes]) -> None:
        frames = replay.recv_multipart()
        peer = frames[0]
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            if peer not in self._warned and len(self._warned) < 1024:
                self._warned.add(peer)
                log.warning("a replay request that is not one sequence number: %.200r", frames[:4])
            return
        start = int.from_bytes(frames[2], "big")
        self.replays += 1
        for seq, payload in self._buffer:
            if seq >= start:
                replay.send_multipart((peer, b"", self._topic, seq_octets(seq), payload))
        replay.send_multipart((peer, b"", b"", END_SEQ, b""))


class PublishedFeed:
    """A ``KvEventFeed`` and its publisher: what changed is flushed after each change; the
    first flush, and the first after a refused batch, restate everything (``snapshot``)."""

    def __init__(self, feed: KvEventFeed, publisher: KvEventPublisher) -> None:
        self.feed = feed
        self.publisher = publisher
        self._restate = True

    def flush(self) -> None:
        if self._restate:
            self._restate = not self.publisher.publish(self.feed.snapshot())
            return
        events = self.feed.take()
        if events and not self.publisher.publish(events):
            self._restate = True


class PublisherMetrics(Collector):
    """The publisher's counters, read at scrape time."""

    def __init__(self, publisher: KvEventPublisher, prefix: str) -> None:
        self.publisher = publisher
        self.prefix = prefix

    def collect(self) -> Iterator[Metric]:
        p, name = self.publisher, self.prefix
        for suffix, value, doc in (
            ("batches", p.batches, "KV event batches published (heartbeats included)"),
            ("events", p.events, "KV events published"),
            ("refused", p.refused, "KV event batches refused by a full queue (state restated)"),
            ("replays", p.replays, "KV event replay requests answered"),
        ):
            yield CounterMetricFamily(f"{name}_{suffix}", doc, value=value)
