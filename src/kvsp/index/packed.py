"""Replica records as the memory store keeps them, pure: a shared skeleton and binary digests.

A record's served JSON tail (``wire.record_tail``) is the same from record to record of one
publisher (holder, codec, size, residency, granted TTL) but for its digests: 64 hex digits each,
a quarter of a plain record and nearly all of one with layer digests. So the store keeps each
distinct skeleton once (the tail with each digest's hex cut out and a NUL in its place: JSON as
pydantic writes it never holds a raw NUL) and per record only the skeleton's number, 4 octets
little-endian, its block key's 32 octets and each digest's 32 octets (the key too: a stored
replica then needs no key string of its own). A block's payload in the key table is its records
packed so, one after another; the table renders its JSON array from them and its space's
identity members (``wire.identity_middle``), in ``_keytable.c`` or in ``render_array`` here:
the same octets ``wire.join_array`` makes from the tails (decision 0026). A published record is
packed from its members (``Skeletons.pack_record``): the tail is written and split once per shape
of record, not once per record, which was most of the cost of an ingest.

What counts as a digest is only a matter of size: any run of exactly 64 lowercase hex digits
that ends a JSON string and starts it or follows a ``:`` (``"sha-256:..."``) is cut, and
rendering puts back the same digits, so packing loses nothing whatever the run means.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Iterator, Sequence
from operator import attrgetter

from kvsp.core.records import ReplicaRecord
from kvsp.index.wire import IDENTITY, RECORD_OPEN, record_tail

__all__ = [
    "MAX_SHAPES",
    "Shape",
    "Skeletons",
    "block_key_of",
    "record_shape",
    "render_array",
    "split_tail",
]

#: a digest's hex digits, captured so that ``split`` answers pieces and digests in turn
_DIGEST = re.compile(rb'(?<=[":])([0-9a-f]{64})(?=")')
_NUMBER = struct.Struct("<I")
#: a packed record's skeleton number and block key, before its digests
_HEAD = 4 + 32


def split_tail(tail: bytes) -> tuple[bytes, bytes]:
    """The tail's skeleton and its digests' octets, in order."""
    if b"\0" in tail:
        raise ValueError("a record's JSON tail holds no NUL")
    pieces = _DIGEST.split(tail)  # one pass: text, digest, text, ..., text
    return b"\0".join(pieces[0::2]), bytes.fromhex(b"".join(pieces[1::2]).decode())


#: shapes remembered at most, each a few hundred octets (publishers vary their records rarely)
MAX_SHAPES = 4096
#: the members that make a record's tail other than its identity and its digests
_SHAPE_MEMBERS = attrgetter(
    *(
        name
        for name in ReplicaRecord.model_fields
        if name not in IDENTITY and name not in {"digest", "layer_digests"}
    )
)


#: what a record's skeleton follows from: ``record_shape``, or a split batch's shape text
Shape = tuple[object, ...] | bytes


def record_shape(record: ReplicaRecord, ttl_ms: int) -> Shape:
    """What a record's skeleton follows from: every member of its tail but the digests' hex
    (the granted TTL for its own), and how many layer digests it has. Everything else the
    store derives from a record but its identity and digests (its cost summary) follows from
    it too, so the store keys that by the same shape."""
    layers = None if record.layer_digests is None else len(record.layer_digests)
    return (ttl_ms, layers, _SHAPE_MEMBERS(record))


def _digest_octets(record: ReplicaRecord) -> bytes:
    """The record's digests' octets in the order its tail holds them."""
    hexes = [record.digest.removeprefix("sha-256:"), *(record.layer_digests or ())]
    return bytes.fromhex("".join(hexes))


def _filled(skeleton: bytes, digests: bytes | memoryview) -> bytes:
    pieces = skeleton.split(b"\0")
    out = [pieces[0]]
    for n, piece in enumerate(pieces[1:]):
        out += (digests[32 * n : 32 * n + 32].hex().encode(), piece)
    return b"".join(out)


def _records(payload: bytes, skeletons: Sequence[bytes | None]) -> Iterator[tuple[bytes, bytes]]:
    """Each packed record's block key (its hex) and tail, rendered; ValueError where the
    payload does not parse."""
    at = 0
    while at < len(payload):
        if len(payload) - at < _HEAD:
            raise ValueError("a packed record is cut short")
        (number,) = _NUMBER.unpack_from(payload, at)
        skeleton = skeletons[number] if number < len(skeletons) else None
        if skeleton is None:
            raise ValueError("a packed record names no skeleton")
        end = at + _HEAD + 32 * skeleton.count(0)
        if end > len(payload):
            raise ValueError("a packed record is cut short")
        key = payload[at + 4 : at + _HEAD].hex().encode()
        yield key, _filled(skeleton, memoryview(payload)[at + _HEAD : end])
        at = end


def block_key_of(packed: bytes) -> str:
    """The block key a record was packed with."""
    return packed[4:_HEAD].hex()


def render_array(identity: bytes, payload: bytes, skeletons: Sequence[bytes | None]) -> bytes:
    """A block's JSON array from its packed records (what the compiled table renders)."""
    records = [RECORD_OPEN + key + identity + tail for key, tail in _records(payload, skeletons)]
    if not records:
        raise ValueError("a block's payload holds no record")
    return b"[" + b",".join(records) + b"]"


class Skeletons:
    """Each distinct skeleton once, counted by the records that use it, so that none outlives
    its last record (publishers that vary their records leave nothing behind). ``listed`` is
    what key tables render from: a freed number holds None until a new skeleton takes it."""

    def __init__(self) -> None:
        self.listed: list[bytes | None] = []
        self._number: dict[bytes, int] = {}
        self._uses: list[int] = []
        self._free: list[int] = []
        #: each record shape's skeleton (``pack_record``)
        self._shapes: dict[Shape, bytes] = {}

    def __len__(self) -> int:
        return len(self._number)

    def skeleton(self, record: ReplicaRecord, ttl_ms: int, shape: Shape) -> bytes | None:
        """The skeleton of the record's tail (``record_tail`` with ``ttl_ms``), rendered once
        per ``shape`` (``record_shape(record, ttl_ms)``, or the text a split batch's records
        share): records that differ only in their block key and digests (a publisher's) share
        it, so the JSON is written and split once for all of them. None for a shape whose
        split finds more than the record's digests (another member of 64 hex digits): its
        records are packed one by one."""
        skeleton = self._shapes.get(shape)
        if skeleton is None:
            skeleton, found = split_tail(record_tail(record, ttl_ms))
            if found != _digest_octets(record):
                return None
            if len(self._shapes) >= MAX_SHAPES:  # publishers that vary every record
                self._shapes.clear()
            self._shapes[shape] = skeleton
        return skeleton

    def pack_record(self, record: ReplicaRecord, ttl_ms: int, shape: Shape) -> bytes:
        """``pack`` of the record's tail, from its shape's ``skeleton`` where it has one."""
        skeleton = self.skeleton(record, ttl_ms, shape)
        if skeleton is None:
            return self.pack(record.block_key, record_tail(record, ttl_ms))
        return self.packed(skeleton, bytes.fromhex(record.block_key) + _digest_octets(record))

    def pack(self, block_key: str, tail: bytes) -> bytes:
        """The record packed: its skeleton's number (now used once more), its block key and
        its digests."""
        skeleton, digests = split_tail(tail)
        return self.packed(skeleton, bytes.fromhex(block_key) + digests)

    def packed(self, skeleton: bytes, key_and_digests: bytes) -> bytes:
        """A record of ``skeleton`` packed from its block key's and digests' octets."""
        head = self.head(skeleton)
        self.add_uses(head, 1)
        return head + key_and_digests

    def head(self, skeleton: bytes) -> bytes:
        """What a record of ``skeleton`` is packed after: its number, the skeleton listed
        (each record packed with it counts itself a use: ``add_uses``)."""
        number = self._number.get(skeleton)
        if number is None:
            if self._free:
                number = self._free.pop()
                self.listed[number] = skeleton
            else:
                number = len(self.listed)
                self.listed.append(skeleton)
                self._uses.append(0)
            self._number[skeleton] = number
        return _NUMBER.pack(number)

    def add_uses(self, packed: bytes, count: int) -> None:
        """``count`` more records were packed as ``packed`` was, after its skeleton's ``head``
        (by ``KeyTable.put_run``, or one by one)."""
        (number,) = _NUMBER.unpack_from(packed)
        self._uses[number] += count

    def release(self, packed: bytes) -> None:
        """A record packed by ``pack`` is gone: its skeleton is used once less."""
        (number,) = _NUMBER.unpack_from(packed)
        self._uses[number] -= 1
        if not self._uses[number]:
            skeleton = self.listed[number]
            assert skeleton is not None
            del self._number[skeleton]
            self.listed[number] = None
            self._free.append(number)

    def tail(self, packed: bytes) -> bytes:
        """The JSON tail a record was packed from."""
        ((_, tail),) = _records(packed, self.listed)
        return tail
