"""The ZMQ publisher over real sockets: sequence numbers from 0 with heartbeats, a replay buffer
bounded in batches, requests that are not a sequence number ignored, a full queue answered by
restating everything, and CURVE: a subscriber without the server key gets nothing."""

from __future__ import annotations

import time

import zmq

from kvsp.kvevents.feed import KvEventFeed
from kvsp.kvevents.publisher import KvEventPublisher, PublishedFeed, PublisherConfig
from kvsp.kvevents.wire import AllBlocksCleared, BlockStored, decode_batch
from tests.servers import free_port


def publisher(**changes: object) -> KvEventPublisher:
    fields: dict[str, object] = {
        "endpoint": "tcp://127.0.0.1:0",
        "replay_endpoint": "tcp://127.0.0.1:0",
        "heartbeat_s": 0,
    }
    fields.update(changes)
    return KvEventPublisher(PublisherConfig(**fields))  # type: ignore[arg-type]


def subscribe(endpoint: str, **options: object) -> zmq.Socket[bytes]:
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    for name, value in options.items():
        setattr(socket, name, value)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(endpoint)
    time.sleep(0.3)  # the subscription reaches the publisher
    return socket


def replay(endpoint: str, start: int) -> list[int]:
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        dealer.send_multipart((b"", b"junk"))  # not a sequence number: ignored
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        seqs = []
        while dealer.poll(3000):
            _, _, seq, _ = dealer.recv_multipart()
            value = int.from_bytes(seq, "big", signed=True)
            if value == -1:
                return seqs
            seqs.append(value)
        raise AssertionError("no end mark")
    finally:
        dealer.close(linger=0)


def test_sequence_numbers_count_every_batch_and_replay_keeps_the_latest() -> None:
    p = publisher(buffer_batches=5, heartbeat_s=0.1)
    try:
        sub = subscribe(p.endpoint)
        for _ in range(8):
            assert p.publish([AllBlocksCleared()])
        time.sleep(0.35)  # and some heartbeats
        seqs: list[int] = []
        while len(seqs) < 11 and sub.poll(1000):  # the 8, then heartbeats
            _, seq, payload = sub.recv_multipart()
            seqs.append(int.from_bytes(seq, "big"))
            decode_batch(payload)
        assert seqs == list(range(len(seqs)))
        assert len(seqs) > 8
        assert len(seqs) == 11
        kept = replay(p.replay_endpoint or "", 0)
        assert len(kept) == 5  # the buffer's latest five
        assert kept == list(range(kept[0], kept[0] + 5))
        assert kept[0] >= seqs[-5]
        assert replay(p.replay_endpoint or "", kept[-2])[:2] == kept[-2:]
        sub.close(linger=0)
    finally:
        p.close()


def test_a_full_queue_is_answered_by_restating_everything() -> None:
    p = publisher(queue_batches=1)
    feed = KvEventFeed(2)
    published = PublishedFeed(feed, p)
    block = ("c" * 64, "s" * 16, "1" * 64)
    feed.learn(block, None, (1, 2))
    feed.resident(block, frozenset({"GPU"}))
    p._queue.put_nowait([])  # the publisher thread is behind: the queue is full
    try:
        published._restate = False
        published.flush()  # refused
        assert p.refused >= 1
        time.sleep(0.3)  # the thread catches up
        sub = subscribe(p.endpoint)
        published.flush()  # nothing new, but the refused batch is restated
        _, _, payload = sub.recv_multipart()
        events = decode_batch(payload).events
        assert isinstance(events[0], AllBlocksCleared)
        assert isinstance(events[1], BlockStored)
        assert events[1].token_ids == [1, 2]
        sub.close(linger=0)
    finally:
        p.close()


def test_with_curve_only_a_subscriber_with_the_server_key_reads() -> None:
    public, secret = zmq.curve_keypair()
    port = free_port()
    p = publisher(endpoint=f"tcp://127.0.0.1:{port}", curve_secret_key=secret.decode())
    try:
        client_public, client_secret = zmq.curve_keypair()
        good = subscribe(
            p.endpoint, curve_serverkey=public, curve_publickey=client_public,
            curve_secretkey=client_secret,
        )  # fmt: skip
        plain = subscribe(p.endpoint)
        p.publish([AllBlocksCleared()])
        assert good.poll(3000)
        assert isinstance(decode_batch(good.recv_multipart()[2]).events[0], AllBlocksCleared)
        assert not plain.poll(300)
        good.close(linger=0)
        plain.close(linger=0)
    finally:
        p.close()
