"""Background tasks of services: stopped together, and waited for, when a service closes; and
the wake-up that lets a reader wait for news instead of polling for it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator

__all__ = ["KeyedLocks", "Wakeup", "cancel_all"]


async def cancel_all(tasks: Iterable[asyncio.Task[None]]) -> None:
    """Cancel every task, then wait until each has finished unwinding."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    for task in pending:
        with contextlib.suppress(asyncio.CancelledError):
            await task


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
