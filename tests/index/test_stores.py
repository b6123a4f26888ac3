"""One behavioural suite, run against the memory store and the Redis store (real time)."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator

import pytest

from kvsp.auth import Principal, Role
from kvsp.core.clock import SystemClock
from kvsp.core.problems import CapacityExhausted, ServiceUnavailable, StaleEpoch
from kvsp.core.records import LookupRequest, LookupResponse
from kvsp.index.queries import decode_lookup
from kvsp.index.replicas import array_of, arrays_of, summary_of
from kvsp.index.rules import IndexLimits
from kvsp.index.service import IndexService
from kvsp.index.stores import MemoryReplicaStore, RedisReplicaStore, ReplicaStore, open_store
from kvsp.index.wire import answer_json
from kvsp.quotas import Quota, Quotas
from tests.index.factories import (
    COMPAT,
    H1,
    H2,
    I1,
    SCOPE_A,
    SCOPE_B,
    key,
    keys,
    ref,
    replica,
    status,
)

pytestmark = pytest.mark.anyio

#: scope B may have 6 records; every other scope as many as the index
LIMITS = IndexLimits(
    max_ttl_ms=2_000, max_records=20, max_scope_records=20, max_descriptors=3,
    quotas=Quotas(scopes={SCOPE_B: Quota(records=6)}),
)  # fmt: skip


async def _expire(store: ReplicaStore) -> None:
    if isinstance(store, RedisReplicaStore):
        await store.expire_due()


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, redis_url: str) -> AsyncIterator[ReplicaStore]:
    if request.param == "memory":
        made: ReplicaStore = MemoryReplicaStore(SystemClock(), LIMITS)
    else:
        made = RedisReplicaStore(redis_url, LIMITS, prefix=f"t{uuid.uuid4().hex[:8]}:")
    yield made
    await made.close()


async def test_prefix_lookup(store: ReplicaStore) -> None:
    await store.publish([replica(0), replica(1), replica(3), replica(0, holder=H2)])
    result = await store.lookup(COMPAT, SCOPE_A, keys(0, 1, 2, 3), [])
    assert [len(r.replicas) for r in result.matched] == [2, 1]
    assert (await store.lookup(COMPAT, SCOPE_B, keys(0), [])).matched == []
    (served,) = json.loads(array_of(result.matched[1]))
    assert served["block_key"] == key(1)
    assert served["ttl_ms"] == 2_000


async def test_the_compact_answer_names_each_holder_with_its_leading_blocks(
    store: ReplicaStore,
) -> None:
    """H1 holds blocks 0-2, H2 blocks 0 and 2 (a gap: one leading block), H3 only block 1."""
    h3 = "http://127.0.0.1:9203/kvsp/"
    await store.publish([replica(n) for n in range(3)])
    await store.publish([replica(0, holder=H2), replica(2, holder=H2), replica(1, holder=h3)])
    await store.put_status(status(I1, links=[{"holder": H1, "mbit_per_s": 8, "rtt_us": 100}]))
    service = IndexService(store)
    pc = Principal("pc", frozenset({Role.CONTROLLER}), frozenset({SCOPE_A}), frozenset())
    body = {"scope_id": SCOPE_A, "compat_id": COMPAT, "block_keys": keys(0, 1, 2, 3)}
    for query in (decode_lookup(json.dumps({**body, "answer": "holders"}).encode()),
                  LookupRequest.parse({**body, "answer": "holders", "targets": [I1],
                                       "block_tokens": 16})):  # fmt: skip
        compact = LookupResponse.parse(await service.lookup(pc, query))
        assert compact.matched == 3
        assert len(compact.estimates) == len(query.targets or ())
        assert [(h.holder, h.blocks) for h in compact.holders or ()] == [(H1, 3), (H2, 1)]
    full = json.loads(await service.lookup(pc, decode_lookup(json.dumps(body).encode())))
    assert full["matched"] == 3
    assert "holders" not in full
    nothing = await service.lookup(pc, decode_lookup(
        json.dumps({**body, "block_keys": keys(7), "answer": "holders"}).encode()
    ))  # fmt: skip
    assert json.loads(nothing) == {"matched": 0, "holders": [], "estimates": []}


async def test_the_answer_is_the_lookup_rendered(store: ReplicaStore) -> None:
    await store.publish([replica(0), replica(0, holder=H2), replica(1), replica(2), replica(4)])
    await store.withdraw([ref(2)])
    await store.publish([replica(1, ttl_ms=1_000)])  # a refresh re-renders the block
    asked = keys(0, 1, 2, 4)
    matched, answer = await store.answer(COMPAT, SCOPE_A, asked)
    assert matched == 2
    assert answer == answer_json(
        arrays_of((await store.lookup(COMPAT, SCOPE_A, asked, [])).matched)
    )
    doc = json.loads(answer)
    assert doc["matched"] == 2
    assert [sorted(r["holder"] for r in rs) for rs in doc["replicas"]] == [[H1, H2], [H1]]
    assert doc["estimates"] == []
    assert await store.answer(COMPAT, SCOPE_B, asked) == (0, answer_json(()))
    assert await store.holders(COMPAT, SCOPE_A, asked) == (2, [(H1, 2), (H2, 1)])
    assert await store.holders(COMPAT, SCOPE_B, asked) == (0, [])
    assert json.loads(answer_json(())) == {"matched": 0, "replicas": [], "estimates": []}


async def test_publish_refresh_withdraw(store: ReplicaStore) -> None:
    first = await store.publish([replica(0), replica(1, ttl_ms=50_000)])
    assert [o.created for o in first] == [True, True]
    assert [o.ttl_ms for o in first] == [2_000, 2_000]  # capped
    again = await store.publish([replica(0)])
    assert [o.created for o in again] == [False]
    assert await store.withdraw([ref(0), ref(0), ref(5)]) == [True, False, False]
    assert (await store.lookup(COMPAT, SCOPE_A, keys(0), [])).matched == []
    assert await store.counts_by_scope() == {SCOPE_A: 1}


async def test_expiry(store: ReplicaStore) -> None:
    await store.publish([replica(0, ttl_ms=150), replica(1, ttl_ms=150), replica(2)])
    await asyncio.sleep(0.3)
    assert (await store.lookup(COMPAT, SCOPE_A, keys(0), [])).matched == []
    await _expire(store)
    assert await store.counts_by_scope() == {SCOPE_A: 1}
    assert await store.expired_total() == 2


async def test_refresh_outlives_the_first_deadline(store: ReplicaStore) -> None:
    await store.publish([replica(0, ttl_ms=1_000)])
    await asyncio.sleep(0.6)
    await store.publish([replica(0, ttl_ms=1_000)])
    await asyncio.sleep(0.6)  # past the first deadline, well before the second
    await _expire(store)
    assert len((await store.lookup(COMPAT, SCOPE_A, keys(0), [])).matched) == 1
    assert await store.expired_total() == 0


async def test_record_limit(store: ReplicaStore) -> None:
    await store.publish([replica(n) for n in range(18)])
    with pytest.raises(CapacityExhausted):
        await store.publish([replica(n) for n in range(18, 21)])
    assert sum((await store.counts_by_scope()).values()) == 18
    await store.publish([replica(n) for n in range(16, 20)])  # two refreshes, two new
    with pytest.raises(CapacityExhausted):
        await store.publish([replica(20)])


async def test_one_scope_cannot_fill_the_index(store: ReplicaStore) -> None:
    """Tenant B floods the index: its records stop at its quota (507 naming it) while tenant A
    still publishes; refreshing a record needs no room."""
    await store.publish([replica(n, scope=SCOPE_B) for n in range(6)])
    with pytest.raises(CapacityExhausted, match="records quota of 6"):
        await store.publish([replica(n, scope=SCOPE_B) for n in range(5, 8)])
    await store.publish([replica(n, scope=SCOPE_B) for n in range(6)])  # refreshes
    await store.publish([replica(n) for n in range(12)])  # A is not held back
    assert await store.counts_by_scope() == {SCOPE_A: 12, SCOPE_B: 6}
    with pytest.raises(CapacityExhausted, match="limit of 20"):  # the index's own limit
        await store.publish([replica(n) for n in range(12, 15)])


async def test_statuses(store: ReplicaStore) -> None:
    await store.put_status(status(I1, epoch=3))
    with pytest.raises(StaleEpoch):
        await store.put_status(status(I1, epoch=2))
    await store.publish([replica(0)])
    result = await store.lookup(COMPAT, SCOPE_A, keys(0), [I1, "http://127.0.0.1:1/kvsp/"])
    assert list(result.statuses) == [I1]
    assert result.statuses[I1].epoch == 3
    await store.put_status(status(I1, epoch=4, ttl_ms=100))
    await asyncio.sleep(0.2)
    assert (await store.lookup(COMPAT, SCOPE_A, keys(0), [I1])).statuses == {}


async def test_summaries_survive_the_store(store: ReplicaStore) -> None:
    await store.publish([replica(0, holder="HTTP://127.0.0.1:9101/kvsp")])
    result = await store.lookup(COMPAT, SCOPE_A, keys(0), [])
    summary = summary_of(result.matched[0].replicas[0])
    assert summary.holder == H1
    assert summary.complete


async def test_two_redis_stores_share_records(redis_url: str) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    a = RedisReplicaStore(redis_url, LIMITS, prefix=prefix)
    b = RedisReplicaStore(redis_url, LIMITS, prefix=prefix)
    try:
        await a.publish([replica(0, ttl_ms=150)])
        assert len((await b.lookup(COMPAT, SCOPE_A, keys(0), [])).matched) == 1
        await asyncio.sleep(0.3)
        removed = await asyncio.gather(a.expire_due(), b.expire_due())
        assert sum(removed) == 1  # expired once, whichever process got there
        assert await a.expired_total() == 1
        assert await b.counts_by_scope() == {}
    finally:
        await a.close()
        await b.close()


async def test_an_unreachable_redis_is_503() -> None:
    from tests.servers import free_port

    store = RedisReplicaStore(f"redis://127.0.0.1:{free_port()}/0", LIMITS)
    try:
        with pytest.raises(ServiceUnavailable, match="unreachable"):
            await store.lookup(COMPAT, SCOPE_A, keys(0), [])
        with pytest.raises(ServiceUnavailable):
            await store.ping()
    finally:
        await store.close()


def test_open_store() -> None:
    assert open_store("memory", LIMITS, SystemClock()).name == "memory"
    assert open_store("redis://127.0.0.1:1/0", LIMITS, SystemClock()).name == "redis"
    with pytest.raises(Exception, match="memory"):
        open_store("postgres://x", LIMITS, SystemClock())


async def test_descriptors_are_kept_once_each_and_bounded(store: ReplicaStore) -> None:
    assert await store.descriptor("ab" * 32) is None
    assert await store.put_descriptor("ab" * 32, b'{"a":1}')
    assert not await store.put_descriptor("ab" * 32, b'{"b":2}')  # an ID names one descriptor
    assert await store.descriptor("ab" * 32) == b'{"a":1}'
    for n in range(1, LIMITS.max_descriptors):
        await store.put_descriptor(f"{n:064x}", b"{}")
    with pytest.raises(CapacityExhausted):
        await store.put_descriptor("cd" * 32, b"{}")
    assert await store.descriptor("cd" * 32) is None
