"""Deadlines, pure: keys that each fall due at a time, taken in the order they fall due.

Leases, pins and instance statuses all expire this way. A heap with lazy deletion: setting a
key's deadline again, or discarding it, leaves its earlier entry in the heap, skipped when it
surfaces; the heap is rebuilt once stale entries outnumber the live ones, so memory stays
O(keys) and taking what is due costs O(due), however often deadlines move.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["Deadlines"]

K = TypeVar("K", bound=Hashable)


class Deadlines(Generic[K]):
    def __init__(self) -> None:
        self._at: dict[K, int] = {}
        #: (deadline, insertion order, key): the order keeps keys from ever being compared
        self._heap: list[tuple[int, int, K]] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, key: object) -> bool:
        return key in self._at

    def get(self, key: K) -> int | None:
        return self._at.get(key)

    def set(self, key: K, at: int) -> None:
        """``key`` falls due at ``at`` (replacing any deadline it had)."""
        self._at[key] = at
        heapq.heappush(self._heap, (at, next(self._order), key))
        if len(self._heap) > 64 + 2 * len(self._at):
            self._heap = [(t, next(self._order), k) for k, t in self._at.items()]
            heapq.heapify(self._heap)

    def discard(self, key: K) -> None:
        self._at.pop(key, None)

    def due(self, now: int) -> list[K]:
        """Every key whose deadline is at or before ``now``, in deadline order; they are
        removed."""
        heap, out = self._heap, []
        while heap and heap[0][0] <= now:
            at, _, key = heapq.heappop(heap)
            if self._at.get(key) == at:
                del self._at[key]
                out.append(key)
        return out
