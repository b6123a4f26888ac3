"""The holder over HTTP, in process: block GET/PUT, layer ranges, leases, verification by the
client, publishing to a real (in-process) Index Service, bad input and authorization."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.responses import JSONResponse

from kvsp.core.clock import ManualClock
from kvsp.core.container import Container
from kvsp.core.digests import parse_repr_digest
from kvsp.core.problems import (
    AlreadyStored,
    ConfigurationError,
    DigestError,
    Forbidden,
    LayersUnavailable,
    LeaseQuotaExceeded,
    NotFound,
    ServiceUnavailable,
)
from kvsp.core.records import LeaseRequest, ReplicaRecord
from kvsp.holder.client import HolderClient
from kvsp.holder.service import HolderConfig, HolderService, parse_index_routes
from kvsp.index.client import IndexClient
from kvsp.web.server import InflightOctets
from tests.holder.env import INDEX, Env, holder_env
from tests.holder.factories import COMPAT, OTHER_SCOPE, SCOPE, block_id, container
from tests.servers import serving

pytestmark = pytest.mark.anyio


@pytest.fixture
async def env() -> AsyncIterator[Env]:
    async with holder_env() as e:
        yield e


def path(n: int, scope: str = SCOPE) -> str:
    compat, s, key = block_id(n, scope)
    return f"blocks/{compat}/{s}/{key}"


async def put_raw(env: Env, n: int, token: str = "c1", **headers: Any) -> httpx.Response:
    sent = {
        "authorization": f"Bearer {token}",
        "content-type": "application/kvsp-block",
        "if-none-match": "*",
        **headers,
    }
    return await env.http.put(path(n), content=container(n).tobytes(), headers=sent)


async def test_put_then_get_serves_the_container_with_its_headers(env: Env) -> None:
    record = await env.client("c1").put(env.holder, block_id(1), container(1))
    assert record.holder == env.holder
    assert record.layer_digests is not None
    response = await env.http.get(path(1), headers={"authorization": "Bearer c2"})
    assert response.status_code == 200
    assert response.content == container(1).tobytes()
    assert response.headers["content-type"] == "application/kvsp-block"
    assert (
        parse_repr_digest(response.headers["repr-digest"])
        == hashlib.sha256(response.content).digest()
    )
    assert response.headers["cache-control"] == "private, immutable, max-age=60"


async def test_verified_get_stream_and_layer_ranges(env: Env) -> None:
    record = await env.client("c1").put(env.holder, block_id(1), container(1))
    c2 = env.client("c2")
    assert (await c2.get(record)).tobytes() == container(1).tobytes()
    part = await c2.get(record, (1, 2))
    assert part.tobytes() == container(1).slice(1, 2).tobytes()
    layers = [layer async for layer in c2.stream(record, (2, 3))]
    assert [layer.layer for layer in layers] == [2, 3]
    assert bytes(layers[0].k) == bytes(container(1).layers[2].k)
    mine = bytearray(record.size)  # octets land in the caller's buffer when it can hold them
    layers = [layer async for layer in c2.stream(record, None, memoryview(mine))]
    assert all(layer.k.obj is mine for layer in layers)
    assert bytes(mine) == container(1).tobytes()
    odd = record.model_copy(update={"holder": "http://127.0.0.1:1/a b/"})
    with pytest.raises(ServiceUnavailable, match="cannot be asked"):  # never a request line
        await c2.get(odd)
    small = bytearray(10)
    layers = [layer async for layer in c2.stream(record, None, memoryview(small))]
    assert len(layers) == record.layer_count
    assert layers[0].k.obj is not small
    with pytest.raises(LayersUnavailable):
        await c2.get(record, (2, 4))
    response = await env.http.get(
        path(1), params={"layers": "0-0", "codec": "1"}, headers={"authorization": "Bearer c1"}
    )
    assert response.status_code == 200
    assert (
        parse_repr_digest(response.headers["repr-digest"])
        == hashlib.sha256(response.content).digest()
    )


async def test_a_whole_block_is_served_alike_whether_the_store_is_free_or_busy(env: Env) -> None:
    record = await env.client("c1").put(env.holder, block_id(1), container(1))
    c2 = env.client("c2")
    hits = env.service.store.stats.hits
    here = await c2.get(record)  # the store is free: read on the event loop
    busy = env.service._lock  # the store's thread is at work: the read waits for it
    busy.acquire()
    pending = asyncio.create_task(c2.get(record))
    await asyncio.sleep(0.05)
    assert not pending.done()
    busy.release()
    there = await pending
    assert here.tobytes() == there.tobytes() == container(1).tobytes()
    assert env.service.store.stats.hits == hits + 2


async def test_second_put_is_412_and_keeps_the_first_copy(env: Env) -> None:
    assert (await put_raw(env, 1)).status_code == 201
    response = await env.http.put(
        path(1),
        content=container(2).tobytes(),
        headers={
            "authorization": "Bearer c1",
            "content-type": "application/kvsp-block",
            "if-none-match": "*",
        },
    )
    assert response.status_code == 412
    assert response.json()["type"].endswith("#kvsp-already-stored")
    got = await env.http.get(path(1), headers={"authorization": "Bearer c1"})
    assert got.content == container(1).tobytes()
    with pytest.raises(AlreadyStored):
        await env.client("c1").put(env.holder, block_id(1), container(1))


@pytest.mark.parametrize(
    ("headers", "body", "status", "slug"),
    [
        ({"if-none-match": ""}, None, 428, "kvsp-precondition-required"),
        ({"content-type": "application/octet-stream"}, None, 415, "kvsp-unsupported-media-type"),
        ({}, b"KVB1 not really", 400, "kvsp-invalid-container"),
        ({}, "slice", 400, "kvsp-invalid-container"),
        ({}, "truncated", 400, "kvsp-invalid-container"),
        ({"authorization": "Bearer other"}, None, 403, "kvsp-forbidden"),
        ({"authorization": "Bearer nobody"}, None, 401, "kvsp-unauthenticated"),
        ({"authorization": ""}, None, 401, "kvsp-unauthenticated"),
    ],
)
async def test_bad_puts_are_problems_and_store_nothing(
    env: Env, headers: dict[str, str], body: Any, status: int, slug: str
) -> None:
    octets = {
        None: container(1).tobytes(),
        "slice": container(1).slice(1, 3).tobytes(),
        "truncated": container(1).tobytes()[:-1],
    }.get(body, body)
    sent = {
        "authorization": "Bearer c1",
        "content-type": "application/kvsp-block",
        "if-none-match": "*",
        **headers,
    }
    response = await env.http.put(path(1), content=octets, headers=sent)
    assert response.status_code == status
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["type"].endswith("#" + slug)
    assert block_id(1) not in env.service.store
    await env.settle()
    assert await env.lookup(1) == 0


@pytest.mark.parametrize(
    ("query", "status"),
    [
        ("layers=3-1", 400),
        ("layers=x", 400),
        ("layers=1-2&layers=1-2", 400),
        ("codec=7", 400),
        ("codec=abc", 400),
        ("codec=%C2%B2", 400),  # a superscript two passes str.isdigit
        ("color=red", 400),
        ("layers=2-9", 404),
        ("layers=4-4", 404),
    ],
)
async def test_bad_gets(env: Env, query: str, status: int) -> None:
    await put_raw(env, 1)
    response = await env.http.get(path(1) + "?" + query, headers={"authorization": "Bearer c1"})
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"


async def test_get_needs_the_scope_and_a_valid_path(env: Env) -> None:
    await put_raw(env, 1)
    response = await env.http.get(path(1), headers={"authorization": "Bearer other"})
    assert response.status_code == 403
    bad = path(1).replace(COMPAT, "zz" * 32)
    assert (await env.http.get(bad, headers={"authorization": "Bearer c1"})).status_code == 400
    assert (await env.http.get(path(5), headers={"authorization": "Bearer c1"})).status_code == 404


class Tamper:
    """An ASGI wrapper that alters a holder's block answers on the way out."""

    def __init__(self, app: Any, mode: str, delay_s: float = 0.0) -> None:
        self.app, self.mode, self.delay_s = app, mode, delay_s

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        bodies = 0  # of this answer: the first is the container's header, then its data

        async def altered(message: dict[str, Any]) -> None:
            nonlocal bodies
            if message["type"] == "http.response.start" and self.mode == "digest":
                message["headers"] = [
                    (k, b"sha-256=:" + b"A" * 43 + b"=:") if k == b"repr-digest" else (k, v)
                    for k, v in message["headers"]
                ]
            if message["type"] == "http.response.start" and self.mode == "no-digest":
                message["headers"] = [(k, v) for k, v in message["headers"] if k != b"repr-digest"]
            if message["type"] == "http.response.body":
                bodies += 1
                body = bytearray(message["body"])
                if self.mode == "flip" and message.get("more_body") is False:
                    body[-1] ^= 1  # in the last layer
                elif self.mode == "flip_early" and bodies == 2:
                    body[10] ^= 1  # in the first layer's K section
                elif self.mode == "cut" and message.get("more_body") is False:
                    raise ConnectionResetError("the holder goes away mid-block")
                message["body"] = bytes(body)
                if bodies == 2:
                    await asyncio.sleep(self.delay_s)  # the header goes out, the data later
            await send(message)

        await self.app(scope, receive, altered)


@pytest.mark.parametrize("mode", ["digest", "flip", "flip_early"])
async def test_client_never_hands_out_octets_that_fail_verification(env: Env, mode: str) -> None:
    record = await env.client("c1").put(env.holder, block_id(1), container(1))
    async with serving(Tamper(env.app, mode), lifespan="off") as tampered:
        client = env.client("c1")
        record = record.model_copy(update={"holder": tampered})
        with pytest.raises(DigestError):
            await client.get(record)
        received: list[int] = []

        async def consume() -> None:
            async for layer in client.stream(record):
                received.append(layer.layer)

        with pytest.raises(DigestError):
            await consume()
    if mode == "flip":
        assert 3 not in received  # the last layer failed its digest before it was handed out
    elif mode == "flip_early":
        assert received == []  # the first layer failed: nothing was handed out
    else:  # each layer matched its own digest, so each was handed out before Repr-Digest failed
        assert received == [0, 1, 2, 3]


@pytest.mark.parametrize("layers", [None, (1, 2)])
async def test_an_answer_without_repr_digest_is_never_used_and_is_counted(
    env: Env, layers: tuple[int, int] | None
) -> None:
    """KVSP 6.7: clients MUST verify Repr-Digest, so an answer without one fails even when every
    layer matched its layer digest (a whole block, a range, or streamed)."""
    record = await env.client("c1").put(env.holder, block_id(1), container(1))
    async with serving(Tamper(env.app, "no-digest"), lifespan="off") as tampered:
        client = env.client("c1")
        record = record.model_copy(update={"holder": tampered})
        with pytest.raises(DigestError, match="no Repr-Digest"):
            await client.get(record, layers)
        with pytest.raises(DigestError, match="no Repr-Digest"):
            async for _ in client.stream(record, layers):
                pass
        assert client.refused == 2


async def test_a_record_without_layer_digests_is_never_fetched_by_layer_range(env: Env) -> None:
    record = await env.client("c1").put(env.holder, block_id(1), container(1))
    bare = ReplicaRecord.parse({**record.to_json(), "layer_digests": None})
    client = env.client("c1")
    with pytest.raises(DigestError, match="never by layer range"):
        await client.get(bare, (0, 1))
    with pytest.raises(DigestError, match="never by layer range"):
        async for _ in client.stream(bare, (2, 3)):
            pass
    assert (await client.get(bare)).digest() == record.digest_octets  # whole: checked whole


async def test_blocks_received_together_are_checked_apart(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several gets at once, their data late (so each is received while others are): checked
    on worker threads, each good block arrives whole and verified and each tampered one fails,
    whatever the others do; a get alone is checked on the loop."""
    client = env.client("c1")
    blocks = [container(n) for n in range(2)]
    records = [await client.put(env.holder, block_id(n), c) for n, c in enumerate(blocks)]
    jobs: list[object] = []
    submit = client._workers.submit
    monkeypatch.setattr(client._workers, "submit", lambda *a: jobs.append(a) or submit(*a))
    async with (
        serving(Tamper(env.app, "flip_early", delay_s=0.05), lifespan="off") as tampered,
        serving(Tamper(env.app, "none", delay_s=0.05), lifespan="off") as slow,
    ):
        asked = [records[0].model_copy(update={"holder": tampered})]
        asked.append(records[1].model_copy(update={"holder": slow}))
        got = await asyncio.gather(*(client.get(r) for r in asked * 3), return_exceptions=True)
        for n, outcome in enumerate(got):
            if n % 2:
                assert isinstance(outcome, Container)
                assert outcome.tobytes() == blocks[1].tobytes()
            else:
                assert isinstance(outcome, DigestError)
    assert jobs  # checked on worker threads
    jobs.clear()
    assert (await client.get(records[1])).tobytes() == blocks[1].tobytes()
    assert not jobs  # alone: checked on the loop


async def test_a_holder_that_goes_away_mid_block_is_unavailable_and_the_client_goes_on(
    env: Env,
) -> None:
    record = await env.client("c1").put(env.holder, block_id(1), container(1))
    async with serving(Tamper(env.app, "cut"), lifespan="off") as cut:
        client = env.client("c1")
        with pytest.raises(ServiceUnavailable):
            await client.get(record.model_copy(update={"holder": cut}))
        assert (await client.get(record)).digest() == record.digest_octets


async def test_client_checks_the_record_it_was_given(env: Env) -> None:
    record = await env.client("c1").put(env.holder, block_id(1), container(1))
    other = ReplicaRecord.parse(
        {**record.to_json(), "layer_digests": None, "digest": "sha-256:" + "00" * 32}
    )
    with pytest.raises(DigestError):
        await env.client("c1").get(other)


async def test_leases_grant_renew_release_quota_and_missing_keys(env: Env) -> None:
    await put_raw(env, 1)
    await put_raw(env, 2)
    c1 = env.client("c1")
    size = env.service.store.meta(block_id(1)).size
    request = LeaseRequest(
        compat_id=COMPAT, scope_id=SCOPE, block_keys=(block_id(1)[2],), ttl_ms=60_000
    )
    with pytest.raises(LeaseQuotaExceeded, match="TTL quota"):  # above the holder's 30 s
        await c1.lease(env.holder, request)
    request = request.model_copy(update={"ttl_ms": 30_000})
    grant = await c1.lease(env.holder, request)
    assert grant.ttl_ms == 30_000
    renewed = await c1.renew(env.holder, grant.lease, 1_000)
    assert renewed.ttl_ms == 1_000
    with pytest.raises(NotFound):
        await env.client("c2").release(env.holder, grant.lease)
    missing = request.model_copy(update={"block_keys": (block_id(2)[2], block_id(9)[2])})
    with pytest.raises(NotFound):
        await c1.lease(env.holder, missing)
    assert env.service.leases.octets_by_scope() == {SCOPE: size}
    many = request.model_copy(update={"block_keys": (block_id(1)[2], block_id(2)[2]) * 1})
    await c1.lease(env.holder, many)  # 3 x size
    with pytest.raises(LeaseQuotaExceeded):
        await c1.lease(env.holder, many)
    response = await env.http.post(
        "leases",
        content=many.model_dump_json(),
        headers={"authorization": "Bearer c1", "content-type": "application/json"},
    )
    assert response.status_code == 429
    assert response.json()["type"].endswith("#kvsp-lease-quota")
    await c1.release(env.holder, grant.lease)
    with pytest.raises(NotFound):
        await c1.release(env.holder, grant.lease)
    with pytest.raises(Forbidden):
        await env.client("other").lease(env.holder, request)


async def test_the_index_hears_of_every_store_and_eviction(env: Env) -> None:
    for n in (1, 2):
        await put_raw(env, n)
    await env.settle()
    assert await env.lookup(1, 2) == 2
    await put_raw(env, 3)  # host holds two blocks and there is no disk: 1 is evicted
    await env.settle()
    assert await env.lookup(1) == 0
    assert await env.lookup(2, 3) == 2
    text = (await env.http.get("metrics", headers={"authorization": "Bearer scraper"})).text
    assert 'kvsp_holder_bytes{tier="host"} 1024.0' in text
    assert 'kvsp_holder_evictions_total{tier="host"} 1.0' in text
    assert "kvsp_holder_index_pending 0.0" in text


async def test_a_put_is_refused_before_its_body_when_the_scope_or_header_is_wrong(
    env: Env,
) -> None:
    """The scope is checked, and the container's header read, from the first octets: a
    wrong-tenant or many-layer PUT is answered while most of its body is still unsent."""
    host, port = env.holder.split("//")[1].split("/")[0].split(":")

    async def answer_to(target: str, first_octets: bytes, declared: int) -> bytes:
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            f"PUT /kvsp/{target} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer c1\r\n"
            f"content-type: application/kvsp-block\r\nif-none-match: *\r\n"
            f"content-length: {declared}\r\n\r\n".encode()
            + first_octets
        )
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        writer.close()
        return head

    head = await answer_to(path(1, OTHER_SCOPE), container(1).tobytes()[:64], 200 << 20)
    assert head.startswith(b"HTTP/1.1 403 ")
    many = Container.build(0, 1, [(b"k", b"v")] * 2000).tobytes()
    head = await answer_to(path(2), many[: 64 * 1024], len(many))
    assert head.startswith(b"HTTP/1.1 400 ")
    assert await env.lookup(1, 2) == 0


async def test_puts_beyond_the_octets_in_flight_are_503_with_retry_after(env: Env) -> None:
    inflight = next(  # the route's budget, shrunk for the test
        c.cell_contents
        for route in env.app.routes
        if getattr(route, "path", "").endswith("{block_key}") and "PUT" in (route.methods or ())
        for c in (route.endpoint.endpoint.__closure__ or ())
        if isinstance(c.cell_contents, InflightOctets)
    )
    inflight.limit = 1000
    size = len(container(1).tobytes())
    with inflight.reserve(1000 - size + 1):
        busy = await put_raw(env, 1)
    assert busy.status_code == 503
    assert busy.headers["retry-after"] == "1"
    assert (await put_raw(env, 1)).status_code == 201  # once the others are done
    assert inflight.held == 0


async def test_an_entry_the_index_refuses_is_dropped_and_the_others_published(env: Env) -> None:
    env.index_service.max_layers = 3  # container(n) has 4 layers; this one has 2
    await put_raw(env, 1)
    small = Container.build(0, 4, [(b"k" * 64, b"v" * 64)] * 2).tobytes()
    answer = await env.http.put(
        path(2),
        content=small,
        headers={"authorization": "Bearer c1", "content-type": "application/kvsp-block",
                 "if-none-match": "*"},
    )  # fmt: skip
    assert answer.status_code == 201
    await env.settle()
    assert await env.lookup(2) == 1  # published despite block 1 in the same batch
    assert await env.lookup(1) == 0
    assert not env.service._pending
    text = (await env.http.get("metrics", headers={"authorization": "Bearer scraper"})).text
    assert 'kvsp_holder_index_refused_total{type="kvsp-invalid-record"} 1.0' in text


async def test_records_are_refreshed_at_half_the_ttl_the_index_granted() -> None:
    async with holder_env(max_ttl_ms=10_000) as env:
        await put_raw(env, 1)
        await env.settle()
        assert env.service.store.refresh_after_ms == 5_000  # not half of its own 60 s


async def test_tiny_blocks_fill_the_host_tier_by_their_number() -> None:
    """Each block counts its metadata (2 KiB by default) beside its octets: a flood of
    two-octet blocks evicts by count instead of growing the holder's memory."""
    service = HolderService(HolderConfig(url="http://127.0.0.1:9/kvsp/", host_bytes=64 << 10))
    tiny = Container.build(0, 1, [(b"k", b"v")]).tobytes()
    for n in range(200):
        await service.store_block(block_id(n), tiny)
    assert len(service.store) <= 32  # 64 KiB / (2 KiB + 2 octets)
    assert service.store.used()["host"] <= 64 << 10
    await service.close()


async def test_a_holder_that_stops_withdraws_what_it_will_no_longer_serve(env: Env) -> None:
    for n in (1, 2):
        await put_raw(env, n)
    await env.settle()
    assert await env.lookup(1, 2) == 2
    await env.service.close()  # host memory only: nothing survives the stop
    assert await env.lookup(1) == 0
    assert await env.lookup(2) == 0


async def test_a_record_left_from_before_a_restart_is_withdrawn_at_its_first_miss(
    env: Env,
) -> None:
    """The holder lost its memory (a restart): the IS still lists a block here. The first GET
    that finds it missing withdraws that record, so lookups stop sending clients here."""
    record = ReplicaRecord.parse(container_record(env, 1))  # as published in a former life
    published = IndexClient(INDEX, "holder", transport=env.index_transport)
    await published.batch(put=[record])
    assert await env.lookup(1) == 1
    missing = await env.http.get(path(1), headers={"authorization": "Bearer c1"})
    assert missing.status_code == 404
    await env.settle()
    assert await env.lookup(1) == 0


def container_record(env: Env, n: int) -> dict[str, Any]:
    """The Replica Record this holder would publish for ``container(n)``."""
    c = container(n)
    compat, scope, key = block_id(n)
    return {
        "block_key": key, "compat_id": compat, "scope_id": scope, "holder": env.holder,
        "codec": c.header.codec, "size": c.size, "digest": "sha-256:" + c.digest().hex(),
        "residency": [{"tier": "host", "layers": [0, c.header.layer_count - 1]}],
        "ttl_ms": 60_000,
    }  # fmt: skip


async def test_a_lease_body_as_the_text_writes_it_names_only_keys_and_a_ttl(env: Env) -> None:
    await put_raw(env, 1)
    await put_raw(env, 2)
    headers = {"authorization": "Bearer c1", "content-type": "application/json"}
    key = block_id(1)[2]
    response = await env.http.post(
        "leases", json={"block_keys": [key], "ttl_ms": 1_000}, headers=headers
    )
    assert response.status_code == 201
    assert response.json()["ttl_ms"] == 1_000
    assert env.service.leases.leased(block_id(1))
    # a key held in a scope the caller may not use answers as a key not held at all
    other = {"authorization": "Bearer other", "content-type": "application/json"}
    hidden = await env.http.post(
        "leases", json={"block_keys": [key], "ttl_ms": 1_000}, headers=other
    )
    absent = await env.http.post(
        "leases", json={"block_keys": [block_id(9)[2]], "ttl_ms": 1_000}, headers=other
    )
    assert (hidden.status_code, absent.status_code) == (404, 404)
    assert hidden.json()["detail"].replace(key, "K") == absent.json()["detail"].replace(
        block_id(9)[2], "K"
    )
    # the extension members narrow the search: a key under another compat id is not held
    wrong = {"block_keys": [key], "ttl_ms": 1_000, "compat_id": "d0" * 32}
    assert (await env.http.post("leases", json=wrong, headers=headers)).status_code == 404
    too_long = await env.http.post(
        "leases", json={"block_keys": [block_id(2)[2]], "ttl_ms": 30_001}, headers=headers
    )
    assert too_long.status_code == 429
    assert too_long.json()["type"].endswith("#kvsp-lease-quota")
    assert not env.service.leases.leased(block_id(2))


async def test_a_faulty_block_is_withdrawn_from_the_index_before_its_octets_go(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    await put_raw(env, 1)
    await env.settle()
    assert await env.lookup(1) == 1
    lease = LeaseRequest(block_keys=(block_id(1)[2],), ttl_ms=10_000)
    await env.client("c1").lease(env.holder, lease)
    store = env.service.store

    def gone_bad(*_: Any) -> memoryview:
        raise DigestError("the tier's octets no longer match their digest")

    monkeypatch.setattr(store._data["host"], "read", gone_bad)  # type: ignore[attr-defined]
    before = store.used()["host"]
    delivered = []
    batch = env.service.index.batch  # type: ignore[union-attr]

    async def watched(put: Any, delete: Any) -> Any:
        delivered.append((store.used()["host"], [r.block_key for r in delete]))
        return await batch(put, delete)

    monkeypatch.setattr(env.service.index, "batch", watched)
    response = await env.http.get(path(1), headers={"authorization": "Bearer c1"})
    assert response.status_code == 404  # even though leased: a fault (KVSP 6.6)
    await env.settle()
    # the withdrawal reached the IS while the octets were still there; then they went
    assert delivered == [(before, [block_id(1)[2]])]
    assert await env.lookup(1) == 0
    assert store.used()["host"] == 0


class IndexWithTheTextsRoutes:
    """The Index Service as KVSP 6.1 alone writes it: no batch route (``POST replicas``
    answers 404 like any unknown route); records every request it sees."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.seen: list[tuple[str, str]] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.seen.append((scope["method"], scope["path"].split("/")[2]))
            if (scope["method"], scope["path"]) == ("POST", "/kvsp/replicas"):
                problem = {"type": "about:blank", "title": "Not found", "status": 404}
                await JSONResponse(problem, 404, media_type="application/problem+json")(
                    scope, receive, send
                )
                return
        await self.app(scope, receive, send)


@pytest.mark.parametrize("routes", ["auto", "text"])
async def test_a_holder_publishes_and_withdraws_with_the_texts_put_and_delete(
    env: Env, routes: str
) -> None:
    index = IndexWithTheTextsRoutes(env.index_app)
    transport = httpx.ASGITransport(app=index)
    holder = HolderService(
        HolderConfig(
            url=env.holder,
            host_bytes=2 * 4 * 128,
            record_ttl_ms=60_000,
            block_overhead_octets=0,
            index_routes=parse_index_routes(routes),
        ),
        ManualClock(),
        IndexClient(INDEX, "holder", transport=transport),
    )
    try:
        for n in (1, 2):
            await holder.store_block(block_id(n), container(n).tobytes())
        await holder._flush()
        assert await env.lookup(1, 2) == 2
        await holder.store_block(block_id(3), container(3).tobytes())  # 1 is evicted
        await holder._flush()
        assert await env.lookup(1) == 0
        assert await env.lookup(2, 3) == 2
        assert holder.routes == "text"
        batches = [s for s in index.seen if s == ("POST", "replicas")]
        assert len(batches) == (1 if routes == "auto" else 0)  # tried once, then never again
        sent = [s for s in index.seen if s != ("POST", "replicas")]
        put, delete = ("PUT", "replicas"), ("DELETE", "replicas")
        assert sent == [put, put, delete, put]  # 1 is withdrawn as 3 comes in
    finally:
        await holder.close()


def test_index_routes_are_auto_batch_or_text() -> None:
    assert [parse_index_routes(r) for r in ("auto", "batch", "text")] == ["auto", "batch", "text"]
    with pytest.raises(ConfigurationError, match="auto, batch or text"):
        parse_index_routes("grpc")


async def test_a_callers_own_error_is_not_taken_for_an_unreachable_holder(env: Env) -> None:
    client = env.client("c1")
    with pytest.raises(ValueError, match="the caller's own bug"):
        async with client._request("GET", env.holder, "healthz"):
            raise ValueError("the caller's own bug")
    with pytest.raises(ServiceUnavailable, match="cannot be asked"):  # the transport's own
        async with client._request("GET", "ftp://127.0.0.1:1/kvsp/", "healthz"):
            pass
    with pytest.raises(ServiceUnavailable, match="unreachable"):
        async with client._request("GET", "http://127.0.0.1:1/kvsp/", "healthz"):
            pass


async def test_the_client_runs_over_any_transport_given(env: Env, tmp_path: Path) -> None:
    """The transport seam: the same holder, served in this process on a Unix socket, stores
    and serves a verified block to a client that connects there (no TCP port involved)."""
    import uvicorn

    from kvsp.web.http1 import unix_socket
    from kvsp.web.serving import uvicorn_config

    socket_path = str(tmp_path / "holder.sock")
    config = uvicorn_config(env.app, "127.0.0.1", 0, "warning", lifespan="off")
    config.uds = socket_path
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    client = HolderClient("c1", transport=unix_socket(socket_path))
    try:
        while not server.started:
            await asyncio.sleep(0.01)
        nowhere = "http://127.0.0.1:1/kvsp/"  # no TCP port: only the socket can answer
        record = await client.put(nowhere, block_id(7), container(7))
        assert (await client.get(record)).tobytes() == container(7).tobytes()
    finally:
        await client.aclose()
        server.should_exit = True
        await task
