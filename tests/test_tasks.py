"""The wake-up that replaces polling: news from the loop or another thread wakes a reader at
once; news before the reader looked is seen by its look; no reader, no wake-up scheduled."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from kvsp.core.problems import ServiceUnavailable
from kvsp.tasks import Background, KeyedLocks, Wakeup

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


async def test_background_work_logs_a_peers_failure_once_and_lets_go_of_finished_tasks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    later = Background(logging.getLogger("kvsp.test"))
    gate = asyncio.Event()

    async def fails() -> None:
        raise ServiceUnavailable("the peer went away")

    async def waits() -> None:
        await gate.wait()

    with caplog.at_level(logging.WARNING, logger="kvsp.test"):
        later.run(fails(), "hints for session s1")
        later.run(waits(), "a slow one")
        await asyncio.sleep(0.01)
    assert [r.getMessage() for r in caplog.records] == ["hints for session s1: the peer went away"]
    assert len(later) == 1
    gate.set()
    await later.drain()
    assert len(later) == 0
    later.run(asyncio.sleep(30), "cancelled at close")
    await later.cancel()
    assert len(later) == 0
