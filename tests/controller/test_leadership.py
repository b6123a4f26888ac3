"""Who leads: two controllers on one Redis state, one lease between them; the holder stops
acting once its own clock says the lease ran out, a deposed leader drops its tables, and a
clean shutdown hands the lease over at once."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from kvsp.controller.leadership import Leadership
from kvsp.controller.stores import MemoryControlStore, RedisControlStore
from kvsp.core.problems import ConfigurationError, NotLeader

pytestmark = pytest.mark.anyio

A, B = "http://127.0.0.1:1/kvsp/", "http://127.0.0.1:2/kvsp/"


class Events:
    def __init__(self) -> None:
        self.elected: list[int] = []
        self.deposed = 0

    async def on_elected(self, token: int) -> None:
        self.elected.append(token)

    def on_deposed(self) -> None:
        self.deposed += 1


@pytest.fixture
async def stores(redis_url: str) -> AsyncIterator[tuple[RedisControlStore, RedisControlStore]]:
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    a, b = RedisControlStore(redis_url, prefix=prefix), RedisControlStore(redis_url, prefix=prefix)
    yield a, b
    await a.close()
    await b.close()


def pair(
    stores: tuple[RedisControlStore, RedisControlStore], lease_ms: int = 300
) -> tuple[Leadership, Events, Leadership, Events]:
    ea, eb = Events(), Events()
    a = Leadership(stores[0], A, lease_ms, ea.on_elected, ea.on_deposed)
    b = Leadership(stores[1], B, lease_ms, eb.on_elected, eb.on_deposed)
    return a, ea, b, eb


async def test_one_leads_the_other_is_told_who(
    stores: tuple[RedisControlStore, RedisControlStore],
) -> None:
    a, ea, b, eb = pair(stores)
    await a.step()
    await b.step()
    assert a.leading()
    assert not b.leading()
    assert a.check() == ea.elected[0]
    assert eb.elected == []
    with pytest.raises(NotLeader) as refused:
        b.check()
    assert refused.value.extensions.get("leader") == A


async def test_a_leader_that_stops_renewing_stops_acting_and_the_standby_takes_over(
    stores: tuple[RedisControlStore, RedisControlStore],
) -> None:
    a, ea, b, eb = pair(stores)
    await a.step()
    await asyncio.sleep(0.35)  # a stalled: no renewal within its lease
    with pytest.raises(NotLeader):
        a.check()
    await b.step()
    assert b.leading()
    assert eb.elected[0] > ea.elected[0]
    await a.step()  # a's renewal finds the lease gone: it is deposed
    assert ea.deposed == 1
    assert not a.leading()
    assert a.depositions == 1
    await a.close()
    await b.close()


async def test_a_clean_close_hands_the_lease_over_at_once(
    stores: tuple[RedisControlStore, RedisControlStore],
) -> None:
    a, _, b, _ = pair(stores, lease_ms=60_000)
    await a.step()
    await a.close()
    await b.step()
    assert b.leading()


async def test_the_memory_store_leads_for_good_and_a_tiny_lease_is_refused() -> None:
    events = Events()
    solo = Leadership(MemoryControlStore(), A, 1500, events.on_elected, events.on_deposed)
    assert solo.permanent
    assert solo.check() == 0
    await solo.step()
    assert solo.leading()
    with pytest.raises(ConfigurationError):
        Leadership(MemoryControlStore(), A, 50, events.on_elected, events.on_deposed)
