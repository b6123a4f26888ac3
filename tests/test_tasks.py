"""The wake-up that replaces polling: news from the loop or another thread wakes a reader at
once; news before the reader looked is seen by its look; no reader, no wake-up scheduled."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from kvsp.tasks import KeyedLocks, Wakeup

pytestmark = pytest.mark.anyio


async def test_news_from_another_thread_wakes_the_reader_at_once() -> None:
    news = Wakeup()
    box: list[int] = []

    async def reader() -> float:
        started = time.monotonic()
        while True:
            with news.waiting() as wait:
                if box:
                    return time.monotonic() - started
                await wait(30.0)

    task = asyncio.create_task(reader())
    await asyncio.sleep(0.05)

    def writer() -> None:
        box.append(1)
        news.fire()

    threading.Thread(target=writer).start()
    assert await asyncio.wait_for(task, 5.0) < 5.0


async def test_news_before_the_look_is_not_missed_and_a_timeout_ends_the_wait() -> None:
    news = Wakeup()
    news.fire()  # nobody waits: nothing is scheduled, nothing is lost
    with news.waiting() as wait:
        started = time.monotonic()
        await wait(0.05)
    assert 0.04 <= time.monotonic() - started < 5.0


async def test_keyed_locks_serialise_one_key_run_others_in_parallel_and_forget_idle_keys() -> None:
    locks = KeyedLocks()
    order: list[str] = []

    async def hold(key: str, name: str, gate: asyncio.Event) -> None:
        async with locks.hold(key):
            order.append(f"{name}+")
            await gate.wait()
            order.append(f"{name}-")

    first, second, other = asyncio.Event(), asyncio.Event(), asyncio.Event()
    tasks = [
        asyncio.create_task(hold("s1", "a", first)),
        asyncio.create_task(hold("s1", "b", second)),
        asyncio.create_task(hold("s2", "c", other)),
    ]
    await asyncio.sleep(0.01)
    assert order == ["a+", "c+"]  # b waits for a; c does not
    assert len(locks) == 2
    second.set()
    other.set()
    await asyncio.sleep(0.01)
    assert order == ["a+", "c+", "c-"]
    first.set()
    await asyncio.gather(*tasks)
    assert order == ["a+", "c+", "c-", "a-", "b+", "b-"]
    assert len(locks) == 0
