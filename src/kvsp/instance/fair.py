"""One engine thread, shared fairly between tenants.

The engine computes one thing at a time. Run a whole request on it and one tenant's
9,000-token prompt held another tenant's one-token request for 120 s. Here every request is cut
into steps (a chunk of its prompt, or one output token) and the thread takes steps round robin
across tenants, first come first served within one: a request waits at most one step of every
other tenant with work (a prompt chunk is a few seconds on these machines), however long their
prompts are.
"""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

__all__ = ["FairWorker"]

T = TypeVar("T")

_Job = tuple[Callable[[], Any], asyncio.Future[Any]]


class FairWorker:
    """Runs callables on one thread, taking turns across the keys they are queued under."""

    def __init__(self, name: str) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._queues: OrderedDict[str, deque[_Job]] = OrderedDict()
        self._busy = False

    def waiting(self) -> int:
        """Steps queued and not started."""
        return sum(len(q) for q in self._queues.values())

    async def run(self, key: str, fn: Callable[[], T]) -> T:
        """``fn()`` on the thread, in ``key``'s turn. Cancelled while queued, it never runs;
        cancelled while running, it finishes and its result is dropped."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(key, deque()).append((fn, future))
        self._next()
        return await future

    def _next(self) -> None:
        while not self._busy and self._queues:
            key, queue = next(iter(self._queues.items()))
            fn, future = queue.popleft()
            if queue:
                self._queues.move_to_end(key)  # the others' turn first
            else:
                del self._queues[key]
            if future.cancelled():
                continue
            self._busy = True
            self._thread.submit(fn).add_done_callback(
                functools.partial(self._hand_back, asyncio.get_running_loop(), future)
            )

    def _hand_back(
        self, loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], done: Future[Any]
    ) -> None:
        """On the thread: the step is done; the loop takes it from here."""
        loop.call_soon_threadsafe(self._finished, future, done)

    def _finished(self, future: asyncio.Future[Any], done: Future[Any]) -> None:
        self._busy = False
        if not future.cancelled():
            error = done.exception()
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(done.result())
        self._next()

    def shutdown(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
