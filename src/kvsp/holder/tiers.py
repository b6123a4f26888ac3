"""Where tiers keep octets: process memory, and files on disk that survive a restart.

Disk files are written atomically (a temporary file in the same directory, fsync, rename, fsync
of the directory), so after a crash a block file is either whole or absent; leftover temporary
files are removed by ``DiskTier.scan``. A file is ``KVSPDSK1``, the length of a JSON header
(4 octets, big-endian), the header (the block's meta and the stored layer range) and the
octets of that range. Every read verifies the layers it returns against the meta's digests,
and ``scan`` verifies every layer of every file, so a flipped byte is found on read and on
restart and the block is never served.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvsp.core.ids import parse_block_key, parse_compat_id, parse_scope_id
from kvsp.core.problems import DigestError, InvalidInput
from kvsp.holder.blocks import BlockId, BlockMeta, verify_layers

__all__ = ["DiskTier", "MemoryTier", "ScanResult"]

Span = tuple[int, int]
_MAGIC = b"KVSPDSK1"
_LENGTH = struct.Struct(">I")
_SUFFIX = ".kvsp"
_TEMP_MARK = ".tmp-"


def _slice(meta: BlockMeta, stored: Span, span: Span) -> tuple[int, int]:
    """Offsets of ``span``'s octets within the octets of ``stored``."""
    base = meta.offsets[stored[0]]
    return meta.offsets[span[0]] - base, meta.offsets[span[1] + 1] - base


class MemoryTier:
    """Octets in process memory. A single buffer handed in is kept as is (no copy); ranges
    assembled from several buffers are joined once."""

    def __init__(self) -> None:
        self._held: dict[BlockId, memoryview] = {}

    def accepts(self, meta: BlockMeta, span: Span) -> bool:
        return True

    def write(
        self, block: BlockId, meta: BlockMeta, span: Span, data: Sequence[memoryview]
    ) -> None:
        self._held[block] = data[0] if len(data) == 1 else memoryview(b"".join(data))

    def read(self, block: BlockId, meta: BlockMeta, stored: Span, span: Span) -> memoryview:
        lo, hi = _slice(meta, stored, span)
        return self._held[block][lo:hi]

    def delete(self, block: BlockId) -> None:
        self._held.pop(block, None)


@dataclass(frozen=True, slots=True)
class ScanResult:
    """One file found by ``scan``: a verified range, or (``meta`` None) a file that failed and
    was removed, with ``problem`` saying why."""

    block: BlockId | None
    path: Path
    meta: BlockMeta | None = None
    span: Span | None = None
    problem: str | None = None


class DiskTier:
    def __init__(self, directory: Path | str) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def accepts(self, meta: BlockMeta, span: Span) -> bool:
        return True

    def path(self, block: BlockId) -> Path:
        compat, scope, key = block
        return self.directory / compat / scope / (key + _SUFFIX)

    def write(
        self, block: BlockId, meta: BlockMeta, span: Span, data: Sequence[memoryview]
    ) -> None:
        path = self.path(block)
        path.parent.mkdir(parents=True, exist_ok=True)
        head = json.dumps({"meta": meta.to_json(), "layers": list(span)}).encode()
        temp = path.with_name(path.name + _TEMP_MARK + os.urandom(6).hex())
        try:
            with open(temp, "wb") as f:
                f.write(_MAGIC + _LENGTH.pack(len(head)) + head)
                for part in data:
                    f.write(part)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        _fsync_directory(path.parent)

    def _open(self, path: Path) -> tuple[BlockMeta, Span, int, bytes]:
        """(meta, stored range, data offset, whole file) of a block file."""
        raw = path.read_bytes()
        if raw[: len(_MAGIC)] != _MAGIC or len(raw) < len(_MAGIC) + _LENGTH.size:
            raise DigestError(f"{path.name}: not a kvsp block file")
        (length,) = _LENGTH.unpack_from(raw, len(_MAGIC))
        start = len(_MAGIC) + _LENGTH.size
        try:
            doc = json.loads(raw[start : start + length])
            meta = BlockMeta.from_json(json.dumps(doc["meta"]))
            first, last = (int(n) for n in doc["layers"])
        except (ValueError, KeyError, TypeError, InvalidInput) as exc:
            raise DigestError(f"{path.name}: unreadable header ({exc})") from None
        if not 0 <= first <= last < meta.layer_count:
            raise DigestError(f"{path.name}: layer range {first}-{last} outside the block")
        return meta, (first, last), start + length, raw

    def read(self, block: BlockId, meta: BlockMeta, stored: Span, span: Span) -> memoryview:
        try:
            found, found_span, offset, raw = self._open(self.path(block))
        except OSError as exc:
            raise DigestError(f"block file unreadable: {exc}") from None
        if found != meta or found_span != stored:
            raise DigestError("block file does not hold the range the store expects")
        lo, hi = _slice(meta, stored, span)
        view = memoryview(raw)[offset + lo : offset + hi]
        verify_layers(meta, span[0], span[1], view)
        return view

    def delete(self, block: BlockId) -> None:
        self.path(block).unlink(missing_ok=True)

    def scan(self) -> Iterator[ScanResult]:
        """Every block file, verified layer by layer; temporary files left by a crash and
        files that fail are removed."""
        for path in sorted(self.directory.glob("*/*/*")):
            block = _block_of(path)
            if _TEMP_MARK in path.name or block is None:
                path.unlink(missing_ok=True)
                continue
            try:
                meta, span, offset, raw = self._open(path)
                data = memoryview(raw)[offset:]
                verify_layers(meta, span[0], span[1], data)
            except (DigestError, OSError) as exc:
                path.unlink(missing_ok=True)
                yield ScanResult(block, path, problem=str(exc))
                continue
            yield ScanResult(block, path, meta, span)


def _block_of(path: Path) -> BlockId | None:
    """The block a file is named for, or None for a name that is not a block file."""
    if not path.name.endswith(_SUFFIX):
        return None
    key = path.name.removesuffix(_SUFFIX)
    compat, scope = path.parent.parent.name, path.parent.name
    try:
        parse_compat_id(compat)
        parse_scope_id(scope)
        parse_block_key(key)
    except InvalidInput:
        return None
    return compat, scope, key


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
