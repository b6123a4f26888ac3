"""SHA-256 of many ranges of one buffer, as a received block needs them, hashed as it fills.

A client checks every octet of a block twice (KVSP 6.7: ``Repr-Digest`` over the container,
the layer digests over each layer). One SHA-256 stream leaves half of a core's SHA unit idle,
waiting on the previous round; the compiled ``_sha256`` runs two streams side by side, so the
container's digest and its layers' digests together cost about what one pass did. The octets
of a block arrive over time: ``RangeHasher`` hashes what has arrived at each call, so most of
the hashing is done by the time the last octet is in. On a CPU without the SHA extensions (or
off x86-64), or where ``_sha256`` could not be built (no C compiler), the same digests come from
``hashlib``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

try:
    from kvsp.core import _sha256
except ImportError:  # built without a C compiler
    _sha256 = None  # type: ignore[assignment]

__all__ = ["ACCELERATED", "RangeHasher", "sha256_ranges"]

#: whether ``RangeHasher`` runs two lanes at a time on this CPU
ACCELERATED: bool = _sha256 is not None and _sha256.ACCELERATED

Buffer = bytes | bytearray | memoryview


class _HashlibRanges:
    """``_sha256.Hasher``'s interface over ``hashlib``, for CPUs without the SHA extensions."""

    def __init__(self, length: int, ranges: Sequence[tuple[int, int]]) -> None:
        for start, stop in ranges:
            if not 0 <= start <= stop <= length:
                raise ValueError(f"range ({start}, {stop}) is not within {length} octets")
        self._length = length
        self._ranges = list(ranges)
        self._at = [start for start, _ in self._ranges]
        self._hashes = [hashlib.sha256() for _ in self._ranges]
        self._digests: dict[int, bytes] = {}

    def advance(self, data: Buffer, filled: int) -> list[int]:
        view = memoryview(data).cast("B")
        if len(view) != self._length:
            raise ValueError(
                f"the buffer has {len(view)} octets; the ranges are within {self._length}"
            )
        if not 0 <= filled <= len(view):
            raise ValueError(f"{filled} octets filled is not within {len(view)}")
        completed = []
        for i, (at, (_, stop)) in enumerate(zip(self._at, self._ranges, strict=True)):
            if i in self._digests:
                continue
            upto = min(stop, filled)
            if upto > at:
                self._hashes[i].update(view[at:upto])
                self._at[i] = upto
            if upto == stop:
                self._digests[i] = self._hashes[i].digest()
                completed.append(i)
        return completed

    def digest(self, index: int) -> bytes:
        if index not in self._digests:
            raise ValueError(f"range {index} is not complete")
        return self._digests[index]


class RangeHasher:
    """The SHA-256 of each ``(start, stop)`` range of a buffer of ``length`` octets, hashed as
    the buffer fills from its start: ``advance`` hashes what its first ``filled`` octets allow
    and returns the indices of the ranges that completed; ``digest`` gives a completed range's
    digest. Lanes take the ranges in order, each the next when it finishes one: a range
    completes at the latest once its octets and those of every range before it are in. Put
    the longest range first. One thread at a time may advance it (hashing runs without the
    GIL)."""

    __slots__ = ("_hasher",)

    def __init__(self, length: int, ranges: Sequence[tuple[int, int]]) -> None:
        self._hasher = (
            _sha256.Hasher(length, ranges) if ACCELERATED else _HashlibRanges(length, ranges)
        )

    def advance(self, data: Buffer, filled: int) -> list[int]:
        """Hash what lies in ``data[:filled]`` (the same buffer each time, filled further);
        the indices of the ranges this completed."""
        return self._hasher.advance(data, filled)

    def digest(self, index: int) -> bytes:
        return self._hasher.digest(index)


def sha256_ranges(data: Buffer, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    """The SHA-256 of ``data[start:stop]`` for each ``(start, stop)``, in order. Put the longest
    range first: each lane takes the next range when it finishes one."""
    view = memoryview(data).cast("B")
    hasher = RangeHasher(len(view), ranges)
    hasher.advance(view, len(view))
    return [hasher.digest(i) for i in range(len(ranges))]
