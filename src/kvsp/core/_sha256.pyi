"""Types of the compiled two-lane SHA-256 (``_sha256.c``)."""

from collections.abc import Sequence

#: whether this CPU has the SHA extensions ``digests`` needs
ACCELERATED: bool

def digests(
    buffer: bytes | bytearray | memoryview, ranges: Sequence[tuple[int, int]], /
) -> list[bytes]: ...
