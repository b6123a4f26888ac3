"""The Index Service over HTTP, in process: routes, bad input, authorization, metrics."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from kvsp.auth import Principals
from kvsp.core.clock import ManualClock
from kvsp.core.compat import CompatibilityDescriptor
from kvsp.core.problems import Forbidden, NotFound, RecordError, Unauthenticated
from kvsp.core.records import MAX_BATCH_ENTRIES, MAX_KEYS_PER_REQUEST, LookupRequest, ReplicaRef
from kvsp.index.app import DEFAULT_MAX_BODY_OCTETS, create_app
from kvsp.index.client import IndexClient, batch_body
from kvsp.index.rules import IndexLimits
from kvsp.index.service import IndexService
from kvsp.index.stores import MemoryReplicaStore
from tests.core.test_golden_vectors import DESCRIPTOR
from tests.index.factories import (
    COMPAT,
    H1,
    H2,
    I1,
    NAMESPACE_A,
    NAMESPACE_B,
    RELAY,
    SCOPE_A,
    SCOPE_B,
    key,
    principals_toml,
    ref,
    replica,
    status,
)

pytestmark = pytest.mark.anyio

PRINCIPALS = principals_toml()
BASE = "http://index.test/kvsp/"


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def service(clock: ManualClock) -> IndexService:
    return IndexService(MemoryReplicaStore(clock, IndexLimits(max_ttl_ms=60_000, max_records=50)))


@pytest.fixture
async def http(service: IndexService) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(service, Principals.parse(PRINCIPALS), max_body_octets=64 * 1024)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as client:
        yield client


def client_for(http: httpx.AsyncClient, token: str | None) -> IndexClient:
    return IndexClient(BASE, token, transport=http._transport)


def lookup_request(*ns: int, scope: str = SCOPE_A, **extra: Any) -> LookupRequest:
    return LookupRequest.parse(
        {"scope_id": scope, "compat_id": COMPAT, "block_keys": [key(n) for n in ns], **extra}
    )


async def test_publish_lookup_withdraw_through_the_client(http: httpx.AsyncClient) -> None:
    holder = client_for(http, "h1")
    pc = client_for(http, "pc")
    assert (await holder.publish(replica(0))).created
    assert not (await holder.publish(replica(0))).created
    await holder.publish(replica(1))
    answer = await pc.lookup(lookup_request(0, 1, 2))
    assert answer.matched == 2
    assert answer.replicas[0][0].block_key == key(0)
    assert answer.replicas[0][0].ttl_ms == 60_000
    await holder.withdraw(ref(1))
    assert (await pc.lookup(lookup_request(0, 1))).matched == 1
    with pytest.raises(NotFound):
        await holder.withdraw(ref(1))


async def test_batch(http: httpx.AsyncClient) -> None:
    holder = client_for(http, "h1")
    put, deleted = await holder.batch(put=[replica(n) for n in range(3)], delete=[ref(7)])
    assert [p.created for p in put] == [True, True, True]
    assert deleted == [False]
    put, deleted = await holder.batch(put=[replica(0)], delete=[ref(1)])
    assert ([p.created for p in put], deleted) == ([False], [True])


async def test_estimates_in_the_lookup(http: httpx.AsyncClient) -> None:
    await client_for(http, "h1").publish(replica(0))
    await client_for(http, "i1").put_status(
        status(I1, links=[{"holder": H1, "mbit_per_s": 8, "rtt_us": 100}])
    )
    answer = await client_for(http, "pc").lookup(
        lookup_request(0, targets=[I1, "http://127.0.0.1:1/kvsp/"], block_tokens=16)
    )
    (estimate,) = answer.estimates
    assert estimate.target == I1
    assert estimate.fetch_us == pytest.approx(100 + 4 * 1000)
    assert estimate.recompute_us == pytest.approx(1e6 * 16 / 400)


async def test_scopes_never_leak(http: httpx.AsyncClient) -> None:
    await client_for(http, "h1").publish(replica(0))
    other = client_for(http, "pc-b")
    with pytest.raises(Forbidden):
        await other.lookup(lookup_request(0))  # scope A: refused, records or not
    with pytest.raises(Forbidden):
        await other.lookup(lookup_request(99))
    assert (await other.lookup(lookup_request(0, scope=SCOPE_B))).matched == 0


@pytest.mark.parametrize(
    ("token", "action", "error"),
    [
        (None, "publish", Unauthenticated),
        ("nobody", "publish", Unauthenticated),
        ("pc", "publish", Forbidden),  # a controller is no holder
        ("i1", "publish", Forbidden),  # an instance publishing for another holder
        ("h1", "publish_b", Forbidden),  # its holder, another scope
        ("h1", "withdraw_h2", Forbidden),
        ("h1", "status", Forbidden),
        ("pc", "status", Forbidden),  # the controller holds no holders entry for I1
    ],
)
async def test_refusals_store_nothing(
    http: httpx.AsyncClient,
    service: IndexService,
    token: str | None,
    action: str,
    error: type[Exception],
) -> None:
    client = client_for(http, token)
    calls = {
        "publish": lambda: client.publish(replica(0)),
        "publish_b": lambda: client.publish(replica(0, scope=SCOPE_B)),
        "withdraw_h2": lambda: client.withdraw(ref(0, holder=H2)),
        "status": lambda: client.put_status(status(I1)),
    }
    await client_for(http, "h1").publish(replica(0, holder=H1))
    before = await service.store.counts_by_scope()
    with pytest.raises(error):
        await calls[action]()
    assert await service.store.counts_by_scope() == before


def _problem(response: httpx.Response, status: int, slug: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert response.json()["type"].endswith("#" + slug)


async def test_bad_input_is_a_problem_and_stores_nothing(
    http: httpx.AsyncClient, service: IndexService
) -> None:
    headers = {"authorization": "Bearer h1", "content-type": "application/kvsp+json"}
    good = replica(0).to_json()
    path = f"replicas/{COMPAT}/{SCOPE_A}/{key(0)}"
    cases: list[tuple[str, str, Any, dict[str, str], int, str]] = [
        (
            "PUT",
            f"replicas/{COMPAT}/{SCOPE_A}/{key(0)[:-1]}X",
            good,
            headers,
            400,
            "kvsp-invalid-key-material",
        ),
        (
            "PUT",
            f"replicas/{COMPAT}/{SCOPE_A}/{key(1)}",
            good,
            headers,
            400,
            "kvsp-invalid-record",
        ),  # path and body disagree
        (
            "PUT",
            path,
            {
                **good,
                "residency": [
                    {"tier": "host", "layers": [0, 2]},
                    {"tier": "disk", "layers": [2, 3]},
                ],
            },
            headers,
            400,
            "kvsp-invalid-record",
        ),
        ("PUT", path, {**good, "block_key": key(0).upper()}, headers, 400, "kvsp-invalid-record"),
        ("PUT", path, "not json", headers, 400, "kvsp-invalid-record"),
        (
            "PUT",
            path,
            good,
            {**headers, "content-type": "text/plain"},
            415,
            "kvsp-unsupported-media-type",
        ),
        ("PUT", path, {**good, "pad": "x" * 70_000}, headers, 413, "kvsp-payload-too-large"),
        (
            "POST",
            "replicas",
            {"put": [good] * (MAX_BATCH_ENTRIES + 1)},
            headers,
            413,
            "kvsp-payload-too-large",
        ),
        ("POST", "replicas", [1, 2], headers, 400, "kvsp-invalid-record"),
        ("DELETE", path, None, headers, 400, "kvsp-invalid-record"),  # no ?holder=
        ("POST", "lookup", {"scope_id": SCOPE_A}, headers, 400, "kvsp-invalid-record"),
        ("GET", "lookup", None, headers, 405, "kvsp-method-not-allowed"),
        ("GET", "nothing-here", None, headers, 404, "kvsp-not-found"),
    ]
    for method, url, body, hdrs, status_code, slug in cases:
        content = (
            body.encode()
            if isinstance(body, str)
            else (None if body is None else json.dumps(body).encode())
        )
        if url == "replicas" and body and isinstance(body, dict) and len(body.get("put", [])) > 100:
            # the oversized batch must not trip the body limit first
            app = create_app(service, Principals.parse(PRINCIPALS), max_body_octets=64 << 20)
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url=BASE
            ) as big:
                response = await big.request(method, url, content=content, headers=hdrs)
        else:
            response = await http.request(method, url, content=content, headers=hdrs)
        _problem(response, status_code, slug)
    assert await service.store.counts_by_scope() == {}


async def test_the_default_body_limit_holds_a_full_batch_and_no_more(clock: ManualClock) -> None:
    """A batch of ``MAX_BATCH_ENTRIES`` ordinary records and the longest lookup fit the
    default limit; one octet more than the limit is refused before it is parsed, and stores
    nothing."""
    limits = IndexLimits(max_ttl_ms=60_000, max_records=2 * MAX_BATCH_ENTRIES)
    service = IndexService(MemoryReplicaStore(clock, limits))
    app = create_app(service, Principals.parse(PRINCIPALS))
    records = [
        replica(n).model_dump_json(exclude_none=True).encode() for n in range(MAX_BATCH_ENTRIES)
    ]
    full = batch_body(records)
    assert len(full) < DEFAULT_MAX_BODY_OCTETS
    longest = lookup_request(*range(MAX_KEYS_PER_REQUEST)).model_dump_json().encode()
    assert len(longest) < DEFAULT_MAX_BODY_OCTETS
    headers = {"Authorization": "Bearer h1", "Content-Type": "application/json"}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=BASE) as http:
        over = full + b" " * (DEFAULT_MAX_BODY_OCTETS + 1 - len(full))
        _problem(
            await http.post("replicas", content=over, headers=headers),
            413,
            "kvsp-payload-too-large",
        )
        assert await service.store.counts_by_scope() == {}
        response = await http.post("replicas", content=full, headers=headers)
        assert response.status_code == 200, response.text
    assert await service.store.counts_by_scope() == {SCOPE_A: MAX_BATCH_ENTRIES}


async def test_health_and_metrics(http: httpx.AsyncClient, clock: ManualClock) -> None:
    holder = client_for(http, "h1")
    await holder.publish(replica(0, ttl_ms=1_000))
    await holder.publish(replica(1))
    pc = client_for(http, "pc")
    await pc.lookup(lookup_request(0, 1, 2, 3))
    with pytest.raises(Forbidden):
        await client_for(http, "pc-b").lookup(lookup_request(0))
    clock.advance(1_000)
    assert await pc.health() == {"status": "ok", "store": "memory"}
    with pytest.raises(Forbidden):  # metrics name scopes: a scraper's token only
        await pc.metrics()
    text = await client_for(http, "scraper").metrics()
    lines = {
        line.split(" ")[0]: line.split(" ")[1]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert lines[f'kvsp_index_records{{scope="{SCOPE_A}"}}'] == "1.0"
    assert lines["kvsp_index_lookups_total"] == "1.0"
    assert lines["kvsp_index_lookup_hits_total"] == "2.0"
    assert lines["kvsp_index_lookup_keys_total"] == "4.0"
    assert lines['kvsp_index_lookup_matched_blocks_bucket{le="2.0"}'] == "1.0"
    assert lines["kvsp_index_expired_records"] == "1.0"
    assert (
        lines['kvsp_index_rejected_requests_total{type="kvsp-forbidden"}'] == "2.0"
    )  # the lookup and the metrics
    assert lines['kvsp_index_publishes_total{result="created"}'] == "2.0"


async def test_record_error_type_is_raised_by_the_client(http: httpx.AsyncClient) -> None:
    response = await http.put(
        f"replicas/{COMPAT}/{SCOPE_A}/{key(0)}",
        content=b"{}",
        headers={"authorization": "Bearer h1", "content-type": "application/json"},
    )
    from kvsp.web.client import raise_for_problem

    with pytest.raises(RecordError, match="block_key"):
        raise_for_problem(response)


async def test_an_unreachable_index_is_unavailable() -> None:
    from kvsp.core.problems import ServiceUnavailable
    from tests.servers import free_port

    async with IndexClient(f"http://127.0.0.1:{free_port()}/kvsp/", "pc", timeout_s=2) as client:
        with pytest.raises(ServiceUnavailable, match="unreachable"):
            await client.lookup(lookup_request(0))


async def test_a_lookup_as_the_text_writes_it_gets_estimates_from_a_registered_descriptor(
    http: httpx.AsyncClient, service: IndexService
) -> None:
    descriptor = CompatibilityDescriptor.parse({**DESCRIPTOR, "block_tokens": 16})
    compat = descriptor.compat_id().hex()
    holder, pc = client_for(http, "h1"), client_for(http, "pc")
    await holder.publish(replica(0, compat_id=compat))
    await client_for(http, "i1").put_status(
        status(I1, links=[{"holder": H1, "mbit_per_s": 8, "rtt_us": 100}])
    )
    # KVSP 6.2's body: keys and targets, no block size
    query = LookupRequest.parse(
        {"scope_id": SCOPE_A, "compat_id": compat, "block_keys": [key(0)], "targets": [I1]}
    )
    assert (await pc.lookup(query)).estimates == ()  # the IS lacks the needed information
    assert await holder.register(descriptor)
    assert not await holder.register(descriptor)  # idempotent
    (estimate,) = (await pc.lookup(query)).estimates
    assert estimate.recompute_us == pytest.approx(1e6 * 16 / 400)
    assert estimate.fetch_us == pytest.approx(100 + 4 * 1000)
    # the ID is recomputed, never taken from the caller (KVSP 4.1)
    wrong = await http.put(
        f"descriptors/{'ab' * 32}",
        content=descriptor.canonical(),
        headers={"authorization": "Bearer h1", "content-type": "application/json"},
    )
    assert wrong.status_code == 400
    assert wrong.json()["type"].endswith("#kvsp-invalid-descriptor")
    assert await service.store.descriptor("ab" * 32) is None
    with pytest.raises(Forbidden):  # only holders and instances say what their IDs mean
        await pc.register(descriptor)


async def test_configured_descriptors_give_estimates_from_the_start(clock: ManualClock) -> None:
    descriptor = CompatibilityDescriptor.parse({**DESCRIPTOR, "block_tokens": 32})
    compat = descriptor.compat_id().hex()
    service = IndexService(MemoryReplicaStore(clock, IndexLimits()), descriptors=[descriptor])
    app = create_app(service, Principals.parse(PRINCIPALS))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url=BASE) as http:
        await client_for(http, "h1").publish(replica(0, compat_id=compat))
        await client_for(http, "i1").put_status(status(I1))
        query = LookupRequest.parse(
            {"scope_id": SCOPE_A, "compat_id": compat, "block_keys": [key(0)], "targets": [I1]}
        )
        (estimate,) = (await client_for(http, "pc").lookup(query)).estimates
        assert estimate.recompute_us == pytest.approx(1e6 * 32 / 400)


async def test_4_4_the_publisher_of_a_moqt_namespace_is_its_holder_not_the_relay(
    http: httpx.AsyncClient,
) -> None:
    a, b = client_for(http, "moqt-a"), client_for(http, "moqt-b")
    mine = replica(0, RELAY, moqt_namespace=NAMESPACE_A)
    theirs = replica(0, RELAY, moqt_namespace=NAMESPACE_B)
    assert (await a.publish(mine)).created
    with pytest.raises(Forbidden):  # the same relay, another publisher's namespace
        await a.publish(theirs)
    with pytest.raises(Forbidden):  # an HTTP holder's record: not a's to publish
        await a.publish(replica(1))
    assert (await b.publish(theirs)).created  # one relay, two publishers: two replicas
    answer = await client_for(http, "pc").lookup(lookup_request(0))
    assert sorted(r.moqt_namespace or "" for r in answer.replicas[0]) == sorted(
        [NAMESPACE_A, NAMESPACE_B]
    )
    named = {"compat_id": COMPAT, "scope_id": SCOPE_A, "block_key": key(0), "holder": RELAY}
    ref_a = ReplicaRef.parse({**named, "moqt_namespace": NAMESPACE_A})
    with pytest.raises(Forbidden):  # b may not withdraw a's replica
        await b.withdraw(ref_a)
    await a.withdraw(ref_a)
    (left,) = (await client_for(http, "pc").lookup(lookup_request(0))).replicas[0]
    assert left.moqt_namespace == NAMESPACE_B
    with pytest.raises(RecordError):  # a moqt holder is named with its namespace
        ReplicaRef.parse(named)
