"""An asyncio event loop on its own thread, so vLLM's synchronous connector calls can use
kvsp's async clients (verified holder GETs, IS lookups) without an event loop of their own."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, work: Coroutine[Any, Any, T]) -> Future[T]:
        """Start ``work`` on the loop; its result or exception arrives in the future."""
        return asyncio.run_coroutine_threadsafe(work, self.loop)

    def run(self, work: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run ``work`` on the loop and wait for it (``TimeoutError`` after ``timeout_s``)."""
        future = self.submit(work)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()
