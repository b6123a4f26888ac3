"""The engine's events for the control plane, pure: numbered, kept in a bounded replay buffer.

What the instance reports (the RFC's engine -> control plane direction):

- ``association``: a session now owns blocks (a hit or an admission), with its frontiers;
- ``residency``: a block is held here in these tiers (stored, demoted, promoted);
- ``eviction``: the last local copy of a block is gone (its record was withdrawn first);
- ``transfer``: a block came from or went to another holder (prefetch, share, remote reuse);
- ``hint``: the outcome of a KvHint action.

Events carry consecutive sequence numbers from 1. A consumer asks for the events after the last
one it saw; the buffer keeps the latest ``capacity``, so a consumer that fell further behind is
told it missed some (``missed``) instead of silently getting a gap. Sequence numbers restart with
the instance, whose epoch is in every answer: a new epoch means start again from 0.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvsp.core.clock import Clock
from kvsp.core.problems import ConfigurationError

__all__ = ["EventLog", "EventPage"]


@dataclass(frozen=True, slots=True)
class EventPage:
    events: list[dict[str, Any]]
    #: the latest sequence number issued (0: none yet)
    last: int
    #: events after the requested one were dropped from the buffer before this read
    missed: bool


class EventLog:
    def __init__(self, clock: Clock, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ConfigurationError("the event buffer needs room for at least one event")
        self.clock = clock
        self._events: deque[dict[str, Any]] = deque(maxlen=capacity)
        self.last = 0
        #: called after each event is appended (a reader waiting for events is woken)
        self.on_append: Callable[[], None] | None = None

    def append(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.last += 1
        event = {"seq": self.last, "kind": kind, "at_ms": self.clock.now_ms(), **fields}
        self._events.append(event)
        if self.on_append is not None:
            self.on_append()
        return event

    def after(self, seq: int, limit: int = 1000) -> EventPage:
        """Up to ``limit`` events after ``seq``, oldest first."""
        if seq < 0 or limit < 1:
            raise ValueError("after must be >= 0 and limit >= 1")
        first = self._events[0]["seq"] if self._events else self.last + 1
        missed = seq + 1 < first and seq < self.last
        start = max(0, seq + 1 - first)
        out = [self._events[i] for i in range(start, min(len(self._events), start + limit))]
        return EventPage(out, self.last, missed)
