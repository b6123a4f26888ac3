"""The controller's Redis state against a real redis-server: the lease and its fencing token,
writes refused once a newer leader fenced the slot, KVSP 6.8's epoch rules decided by the
checkpoint script, the failover move, and a load that gives back what was written."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from kvsp.controller.hints import SessionHints
from kvsp.controller.instances import TrackedInstance
from kvsp.controller.sessions import Session
from kvsp.controller.stores import (
    DropDecision,
    DropSession,
    MemoryControlStore,
    PutDecision,
    PutHints,
    PutInstance,
    PutMap,
    PutReshard,
    PutSession,
    RedisControlStore,
    open_control_store,
)
from kvsp.core.problems import (
    Forbidden,
    InvalidInput,
    NotFound,
    NotLeader,
    ServiceUnavailable,
    StaleEpoch,
)
from kvsp.core.records import InstanceState
from kvsp.local import free_port
from tests.controller.factories import SESSION, checkpoint, shard_map
from tests.index.factories import COMPAT, I1, I2, SCOPE_A, status

pytestmark = pytest.mark.anyio

LEASE_MS = 2000


@pytest.fixture
async def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}:"


@pytest.fixture
async def store(redis_url: str, prefix: str) -> AsyncIterator[RedisControlStore]:
    made = RedisControlStore(redis_url, prefix=prefix)
    yield made
    await made.close()


def session(epoch: int = 0, instance: str = I1, generated: int = 0) -> Session:
    return Session(
        SESSION, SCOPE_A, COMPAT, instance, epoch, checkpoint(generated, epoch), max_tokens=64
    )


async def lead(store: RedisControlStore, me: str = "http://127.0.0.1:1") -> int:
    token, holder = await store.acquire(me, LEASE_MS)
    assert token is not None
    assert holder == me
    await store.fence(token, [SCOPE_A])
    return token


async def test_one_holder_at_a_time_and_each_acquisition_a_higher_token(
    store: RedisControlStore,
) -> None:
    first, _ = await store.acquire("http://a", LEASE_MS)
    assert first is not None
    assert await store.acquire("http://b", LEASE_MS) == (None, "http://a")
    assert await store.renew(first, "http://a", LEASE_MS)
    assert not await store.renew(first, "http://b", LEASE_MS)
    await store.release(first, "http://b")  # not b's to release
    assert await store.acquire("http://b", LEASE_MS) == (None, "http://a")
    await store.release(first, "http://a")
    second, holder = await store.acquire("http://b", LEASE_MS)
    assert holder == "http://b"
    assert second is not None
    assert second > first
    assert not await store.renew(first, "http://a", LEASE_MS)


async def test_a_lapsed_lease_is_taken_by_the_next_controller(store: RedisControlStore) -> None:
    first, _ = await store.acquire("http://a", 100)
    await asyncio.sleep(0.25)
    second, holder = await store.acquire("http://b", LEASE_MS)
    assert holder == "http://b"
    assert first is not None
    assert second == first + 1


async def test_an_old_leaders_writes_are_refused_once_a_new_one_fenced(
    store: RedisControlStore,
) -> None:
    old = await lead(store, "http://a")
    await store.write(old, [PutSession(session(), 1)])
    await store.release(old, "http://a")
    new = await lead(store, "http://b")
    with pytest.raises(NotLeader):
        await store.write(old, [PutSession(session(epoch=0, instance=I2), 2)])
    with pytest.raises(NotLeader):
        await store.checkpoint(old, checkpoint(3), I1)
    with pytest.raises(NotLeader):
        await store.move(old, SCOPE_A, SESSION, I1, 0, I2)
    with pytest.raises(NotLeader):
        await store.write(old, [PutDecision("d1", 10.0)])
    loaded = await store.load()
    assert [(s.instance, s.checkpoint.output_offset) for s in loaded.sessions] == [(I1, 0)]
    assert loaded.decisions == {}
    await store.write(new, [PutDecision("d1", 10.0)])
    assert (await store.load()).decisions == {"d1": 10.0}


async def test_the_checkpoint_script_keeps_the_highest_offset_of_the_current_epoch(
    store: RedisControlStore,
) -> None:
    token = await lead(store)
    await store.write(token, [PutSession(session(epoch=2), 1)])
    await store.checkpoint(token, checkpoint(5, epoch=2), I1)
    await store.checkpoint(token, checkpoint(3, epoch=2), I1)  # lower: kept, not an error
    with pytest.raises(StaleEpoch):
        await store.checkpoint(token, checkpoint(9, epoch=1), I1)
    with pytest.raises(InvalidInput):
        await store.checkpoint(token, checkpoint(9, epoch=3), I1)
    with pytest.raises(Forbidden):
        await store.checkpoint(token, checkpoint(9, epoch=2), I2)
    (kept,) = (await store.load()).sessions
    assert (kept.epoch, kept.checkpoint.output_offset) == (2, 5)
    assert list(kept.checkpoint.generated) == list(range(100, 105))


async def test_a_checkpoint_of_an_unknown_session_is_not_found(store: RedisControlStore) -> None:
    token = await lead(store)
    with pytest.raises(NotFound):
        await store.checkpoint(token, checkpoint(1), I1)


async def test_a_move_raises_the_epoch_once_and_only_from_where_the_mover_saw_it(
    store: RedisControlStore,
) -> None:
    token = await lead(store)
    await store.write(token, [PutSession(session(epoch=0), 1)])
    await store.checkpoint(token, checkpoint(4, epoch=0), I1)
    moved, resume_from = await store.move(token, SCOPE_A, SESSION, I1, 0, I2)
    assert moved
    assert resume_from is not None
    assert (resume_from.epoch, resume_from.output_offset) == (1, 4)
    # a second mover that saw epoch 0 on I1 moves nothing
    assert await store.move(token, SCOPE_A, SESSION, I1, 0, I2) == (False, None)
    with pytest.raises(StaleEpoch):
        await store.checkpoint(token, checkpoint(6, epoch=0), I1)
    await store.checkpoint(token, checkpoint(6, epoch=1), I2)
    (kept,) = (await store.load()).sessions
    assert (kept.instance, kept.epoch, kept.failovers, kept.checkpoint.output_offset) == (
        I2,
        1,
        1,
        6,
    )
    assert await store.move(token, SCOPE_A, "no-such-session", I1, 0, I2) == (False, None)


async def test_load_gives_back_every_kind_of_change(
    store: RedisControlStore, redis_url: str, prefix: str
) -> None:
    token = await lead(store)
    entry = TrackedInstance(I1, status(I1, epoch=3), InstanceState.DRAINING, 3, 0)
    hints = SessionHints(SESSION, I1, 1000, True, False)
    hints.gaps_ms = [10, 20]
    hints.outcomes["kv.pin:accepted"] = 2
    outcome = {"map": "m1", "commit": 2, "members": [I1]}
    other = Session("other", SCOPE_A, COMPAT, I2, 0, checkpoint(0).model_copy(), pending=True)
    await store.write(
        token,
        [
            PutInstance(entry),
            PutSession(session(), 2),
            PutSession(other, 1),
            PutHints(SCOPE_A, hints),
            PutMap(shard_map(1, (0, 1 << 20, I1))),
            PutReshard("m1", outcome),
            PutDecision("d1", 12.5),
            PutDecision("d2", 1.0),
            DropDecision("d2"),
        ],
    )
    loaded = await store.load()
    (instance,) = loaded.instances
    assert (instance.url, instance.state, instance.epoch) == (I1, InstanceState.DRAINING, 3)
    assert instance.status == entry.status
    assert [s.session for s in loaded.sessions] == ["other", SESSION]  # by last use
    assert loaded.sessions[1].max_tokens == 64
    assert [s.pending for s in loaded.sessions] == [True, False]  # a failover to finish
    (got,) = loaded.hints
    assert (got.instance, got.turn_ended_ms, got.tool_call) == (I1, 1000, True)
    assert got.gaps_ms == [10, 20]
    assert got.outcomes["kv.pin:accepted"] == 2
    assert [m.map for m in loaded.maps] == ["m1"]
    assert loaded.reshards == [outcome]
    assert loaded.decisions == {"d1": 12.5}
    await store.write(token, [DropSession(SCOPE_A, SESSION), PutReshard("m1", None)])
    await store.write(token, [PutHints(SCOPE_A, hints)])  # late hints recreate nothing
    raw = aioredis.Redis.from_url(redis_url)
    assert not await raw.exists(f"{prefix}{{s:{SCOPE_A}}}:session:{SESSION}")
    await raw.aclose()
    loaded = await store.load()
    assert [s.session for s in loaded.sessions] == ["other"]
    assert loaded.reshards == []


async def test_two_prefixes_share_nothing(redis_url: str, store: RedisControlStore) -> None:
    token = await lead(store)
    await store.write(token, [PutSession(session(), 1)])
    other = RedisControlStore(redis_url, prefix=f"t{uuid.uuid4().hex[:8]}:")
    try:
        assert (await other.load()).sessions == []
        assert (await other.acquire("http://x", LEASE_MS))[0] == 1
    finally:
        await other.close()


async def test_an_unreachable_redis_is_a_503_not_a_hang() -> None:
    store = RedisControlStore(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2)
    try:
        with pytest.raises(ServiceUnavailable):
            await store.acquire("http://a", LEASE_MS)
        with pytest.raises(ServiceUnavailable):
            await store.load()
    finally:
        await store.close()


async def test_the_memory_store_always_leads_and_keeps_nothing() -> None:
    store = open_control_store("memory")
    assert isinstance(store, MemoryControlStore)
    assert await store.acquire("http://a", LEASE_MS) == (0, "http://a")
    await store.write(0, [PutSession(session(), 1)])
    assert (await store.load()).sessions == []


def test_a_state_that_is_neither_memory_nor_redis_is_refused() -> None:
    with pytest.raises(InvalidInput):
        open_control_store("etcd://127.0.0.1:2379")
