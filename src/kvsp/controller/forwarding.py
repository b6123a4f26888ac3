"""Instance statuses forwarded to the Index Service without holding up the instance.

The controller used to answer ``PUT status`` only after the IS had taken the same status; an IS
that took 5 s made the status late, the controller then marked the live instance failed, and
the cluster lost it for good. Now the answer never waits: statuses wait here, one per instance
(a newer status replaces the one not yet sent: the IS only needs the latest), at most
``capacity`` instances at once (the oldest dropped), and one task sends them.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from kvsp.core.problems import KvspError
from kvsp.core.records import InstanceStatusRecord

__all__ = ["StatusForwarder"]

log = logging.getLogger("kvsp.controller")


class StatusForwarder:
    """Newest-wins, bounded forwarding of statuses through ``send``."""

    def __init__(
        self,
        send: Callable[[InstanceStatusRecord], Awaitable[None]],
        capacity: int = 65_536,
    ) -> None:
        self._send = send
        self._capacity = capacity
        self._waiting: OrderedDict[str, InstanceStatusRecord] = OrderedDict()
        self._wake = asyncio.Event()
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def offer(self, status: InstanceStatusRecord) -> None:
        """Queue ``status`` for sending (replacing its instance's unsent one); never waits."""
        self._waiting.pop(status.instance, None)
        self._waiting[status.instance] = status
        while len(self._waiting) > self._capacity:
            self._waiting.popitem(last=False)
            self.dropped += 1
        self._wake.set()

    async def run(self) -> None:
        """Send what waits, oldest first, until cancelled; a failure is logged and the next
        status of that instance tries again."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._waiting:
                _, status = self._waiting.popitem(last=False)
                try:
                    await self._send(status)
                except KvspError as exc:
                    log.warning("status of %s not forwarded to the index: %s", status.instance, exc)
