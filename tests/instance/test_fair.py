"""The engine thread's turns: round robin across tenants, in order within one."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvsp.instance.fair import FairWorker

pytestmark = pytest.mark.anyio


async def test_steps_take_turns_across_tenants_and_keep_their_order_within_one() -> None:
    worker = FairWorker("test-fair")
    order: list[str] = []
    gate = threading.Event()

    def step(name: str) -> str:
        if name == "a0":
            gate.wait(5)  # hold the thread until every other step is queued
        order.append(name)
        return name

    first = asyncio.ensure_future(worker.run("a", lambda: step("a0")))
    await asyncio.sleep(0.05)
    queued = [
        asyncio.ensure_future(worker.run(key, lambda n=f"{key}{i}": step(n)))
        for key, i in [("a", 1), ("a", 2), ("a", 3), ("b", 1), ("c", 1), ("b", 2)]
    ]
    await asyncio.sleep(0)
    assert worker.waiting() == 6
    gate.set()
    assert await first == "a0"
    assert [await q for q in queued] == ["a1", "a2", "a3", "b1", "c1", "b2"]
    # one long-prompt tenant ("a") waits behind one step of each other tenant, not the reverse
    assert order == ["a0", "a1", "b1", "c1", "a2", "b2", "a3"]
    worker.shutdown()


async def test_a_cancelled_step_never_runs_and_errors_reach_the_caller() -> None:
    worker = FairWorker("test-fair")
    ran: list[int] = []
    gate = threading.Event()
    busy = asyncio.ensure_future(worker.run("a", lambda: gate.wait(5)))
    await asyncio.sleep(0.05)
    dropped = asyncio.ensure_future(worker.run("b", lambda: ran.append(1)))
    await asyncio.sleep(0)
    dropped.cancel()
    gate.set()
    await busy

    def fails() -> None:
        raise ValueError("bad step")

    with pytest.raises(ValueError, match="bad step"):
        await worker.run("b", fails)
    assert await worker.run("b", lambda: 7) == 7
    assert ran == []
    worker.shutdown()
