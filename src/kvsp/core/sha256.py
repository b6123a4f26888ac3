"""SHA-256 of many ranges of one buffer, as a received block needs them.

A client checks every octet of a block twice (KVSP 6.7: ``Repr-Digest`` over the container,
the layer digests over each layer). One SHA-256 stream leaves half of a core's SHA unit idle,
waiting on the previous round; the compiled ``_sha256`` runs two streams side by side, so the
container's digest and its layers' digests together cost about what one pass did. On a CPU
without the SHA extensions (or off x86-64) the same digests come from ``hashlib``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kvsp.core import _sha256

__all__ = ["ACCELERATED", "sha256_ranges"]

#: whether ``sha256_ranges`` runs two lanes at a time on this CPU
ACCELERATED: bool = _sha256.ACCELERATED


def sha256_ranges(
    data: bytes | bytearray | memoryview, ranges: Sequence[tuple[int, int]]
) -> list[bytes]:
    """The SHA-256 of ``data[start:stop]`` for each ``(start, stop)``, in order. Put the longest
    range first: each lane takes the next range when it finishes one."""
    if ACCELERATED:
        return _sha256.digests(data, ranges)
    view = memoryview(data).cast("B")
    for start, stop in ranges:
        if not 0 <= start <= stop <= len(view):
            raise ValueError(f"range ({start}, {stop}) is not within {len(view)} octets")
    return [hashlib.sha256(view[start:stop]).digest() for start, stop in ranges]
