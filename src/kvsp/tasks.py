"""Background tasks of services: stopped together, and waited for, when a service closes; and
the wake-up that lets a reader wait for news instead of polling for it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Iterator
from typing import Any

from kvsp.core.problems import KvspError

__all__ = ["Background", "KeyedLocks", "Wakeup", "cancel_all"]


async def cancel_all(tasks: Iterable[asyncio.Task[None]]) -> None:
    """Cancel every task, then wait until each has finished unwinding."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    for task in pending:
        with contextlib.suppress(asyncio.CancelledError):
            await task


class Background:
    """Work a service runs beside what caused it (nobody waits for its answer): a peer's
    failure is logged in one line, ``what: detail``, never left in a task nobody awaits;
    finished tasks let go of themselves."""

    def __init__(self, log: logging.Logger, level: int = logging.WARNING) -> None:
        self._log = log
        self._level = level
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def run(self, work: Coroutine[Any, Any, object], what: str) -> None:
        async def guarded() -> None:
            try:
                await work
            except KvspError as exc:
                self._log.log(self._level, "%s: %s", what, exc.detail)

        task = asyncio.get_running_loop().create_task(guarded())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: work.close())  # cancelled before it started

    async def drain(self) -> None:
        """Wait for what is still running (a clean shutdown lets it finish)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def cancel(self) -> None:
        await cancel_all(list(self._tasks))


class Wakeup:
    """Wakes whoever waits for news, when ``fire`` is called from the loop or any thread.

    A reader checks for what it wants inside ``waiting()`` and then waits: news that comes
    after the check wakes it (``fire`` sees the reader), and news before the check is seen by
    the check itself, so nothing is missed and no one polls. With no reader waiting, ``fire``
    costs a read of one counter."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event = asyncio.Event()
        self._readers = 0

    def fire(self) -> None:
        if self._readers and self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[Callable[[float], Awaitable[None]]]:
        """Within the block, news from here on wakes the returned wait (at most a timeout)."""
        self._loop = asyncio.get_running_loop()
        event = self._event
        self._readers += 1

        async def wait(timeout_s: float) -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), max(timeout_s, 0.0))

        try:
            yield wait
        finally:
            self._readers -= 1


class KeyedLocks:
    """One lock per key (a session), kept only while someone holds or waits for it: the
    operations on one key run one at a time across their awaits, those on others in
    parallel, and idle keys cost nothing."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def __len__(self) -> int:
        return len(self._locks)

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)
