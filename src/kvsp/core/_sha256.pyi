"""Types of the compiled two-lane SHA-256 (``_sha256.c``)."""

from collections.abc import Sequence

#: whether this CPU has the SHA extensions ``Hasher`` needs
ACCELERATED: bool

class Hasher:
    def __init__(self, length: int, ranges: Sequence[tuple[int, int]]) -> None: ...
    def advance(self, buffer: bytes | bytearray | memoryview, filled: int, /) -> list[int]: ...
    def digest(self, index: int, /) -> bytes: ...
