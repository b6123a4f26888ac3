"""Time as an injected dependency.

Every TTL, lease, deadline and epoch check in kvsp reads a ``Clock`` in milliseconds, so state
machines stay pure: tests and the simulator drive a ``ManualClock`` in virtual time, services
use ``SystemClock``.
"""

from __future__ import annotations

import time
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "ManualClock", "SystemClock"]


@runtime_checkable
class Clock(Protocol):
    def now_ms(self) -> int:
        """Milliseconds on a clock that never goes backward (for TTLs and deadlines)."""
        ...

    def wall_ms(self) -> int:
        """Milliseconds since the Unix epoch (for epochs and logs)."""
        ...


class SystemClock:
    """The process clocks: monotonic for durations, wall time for epochs."""

    def now_ms(self) -> int:
        return time.monotonic_ns() // 1_000_000

    def wall_ms(self) -> int:
        return time.time_ns() // 1_000_000


class ManualClock:
    """A clock that moves only when told; both readings advance together."""

    def __init__(self, start_ms: int = 0, wall_start_ms: int = 1_700_000_000_000) -> None:
        self._now = start_ms
        self._wall_offset = wall_start_ms - start_ms

    def now_ms(self) -> int:
        return self._now

    def wall_ms(self) -> int:
        return self._now + self._wall_offset

    def advance(self, ms: int) -> None:
        if ms < 0:
            raise ValueError("a clock never moves backward")
        self._now += ms

    def set(self, now_ms: int) -> None:
        if now_ms < self._now:
            raise ValueError("a clock never moves backward")
        self._now = now_ms
