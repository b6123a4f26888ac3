"""Background tasks of services: stopped together, and waited for, when a service closes."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable

__all__ = ["cancel_all"]


async def cancel_all(tasks: Iterable[asyncio.Task[None]]) -> None:
    """Cancel every task, then wait until each has finished unwinding."""
    pending = list(tasks)
    for task in pending:
        task.cancel()
    for task in pending:
        with contextlib.suppress(asyncio.CancelledError):
            await task
