"""The octets the Index Service serves, pure: records as JSON tails, blocks as JSON arrays,
lookup answers (KVSP 6.2), and block keys packed 32 octets each.

A record's served JSON is its block's identity prefix (the members every record of a block
shares) followed by its tail (everything else, with the granted ``ttl_ms``). Stores keep only
tails (the memory store packs them: ``packed.py``); a block's array is ``[`` + the records
joined by ``,`` + ``]``.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from typing import overload

from kvsp.core.records import ReplicaRecord

__all__ = [
    "ANSWER_END",
    "ANSWER_HEAD",
    "ANSWER_MIDDLE",
    "IDENTITY",
    "RECORD_OPEN",
    "PackedKeys",
    "Space",
    "answer_json",
    "batch_json",
    "holders_json",
    "identity_middle",
    "identity_prefix",
    "join_array",
    "probed",
    "published_json",
    "record_tail",
]

Space = tuple[str, str]
"""(compat_id, scope_id): the Block Keys of one space never collide with another's."""

#: the members every record of a block shares, first in its served JSON
IDENTITY = frozenset({"block_key", "compat_id", "scope_id"})


#: how every record's JSON begins, before its block key's hex
RECORD_OPEN = b'{"block_key":"'


def identity_middle(space: Space) -> bytes:
    """What follows a record's block key: its space's identity members, then its tail."""
    compat, scope = space
    return b'","compat_id":"%s","scope_id":"%s",' % (compat.encode(), scope.encode())


def identity_prefix(space: Space, block_key: str) -> bytes:
    """How the JSON of every record of a block begins: its identity members."""
    return RECORD_OPEN + block_key.encode() + identity_middle(space)


def record_tail(record: ReplicaRecord, ttl_ms: int) -> bytes:
    """The record's served JSON (with the granted, capped ``ttl_ms``) after its identity
    prefix: the record without its identity members, less the opening brace."""
    if record.ttl_ms != ttl_ms:
        record = record.model_copy(update={"ttl_ms": ttl_ms})
    rest = record.model_dump_json(by_alias=True, exclude_none=True, exclude=set(IDENTITY))
    return rest.encode()[1:]


def join_array(prefix: bytes, tails: Sequence[bytes]) -> bytes:
    """The JSON array of a block's records, from its identity prefix and their tails."""
    return b"[" + b",".join(prefix + tail for tail in tails) + b"]"


#: a lookup answer is ANSWER_HEAD, the matched count, ANSWER_MIDDLE, the blocks' arrays joined
#: by ``,``, ANSWER_END's ``],"estimates":[``, the estimates and ``]}``
ANSWER_HEAD = b'{"matched":'
ANSWER_MIDDLE = b',"replicas":['
ANSWER_END = b'],"estimates":['


def answer_json(arrays: Sequence[bytes], estimates: bytes = b"") -> bytes:
    """A whole lookup answer (KVSP 6.2) for the matched blocks' arrays and the estimates."""
    return b"%s%d%s%s%s%s]}" % (
        ANSWER_HEAD,
        len(arrays),
        ANSWER_MIDDLE,
        b",".join(arrays),
        ANSWER_END,
        estimates,
    )


def published_json(created: bool, ttl_ms: int) -> bytes:
    """The answer to one record's publish: ``PUT``'s body, an entry of ``POST replicas``'."""
    return b'{"created":%s,"ttl_ms":%d}' % (b"true" if created else b"false", ttl_ms)


def batch_json(published: Sequence[tuple[bool, int]], withdrawn: Sequence[bool]) -> bytes:
    """``POST replicas``' answer: each put's (created, granted TTL), each delete's outcome.
    Like outcomes in a row (a holder's batch of new records) are rendered once."""
    puts = b",".join(
        b",".join([published_json(*outcome)] * len(list(run)))
        for outcome, run in itertools.groupby(published)
    )
    deletes = b",".join(b'{"withdrawn":true}' if w else b'{"withdrawn":false}' for w in withdrawn)
    return b'{"put":[%s],"delete":[%s]}' % (puts, deletes)


def holders_json(runs: Sequence[tuple[str, int]], estimates: bytes = b"") -> bytes:
    """A compact lookup answer (``"answer": "holders"``): each holder of the matched prefix
    with the count of its leading blocks it holds (``holder_runs``), and the estimates."""
    listed = b",".join(
        b'{"holder":%s,"blocks":%d}' % (json.dumps(holder).encode(), blocks)
        for holder, blocks in runs
    )
    matched = max((blocks for _, blocks in runs), default=0)
    return b'{"matched":%d,"holders":[%s],"estimates":[%s]}' % (matched, listed, estimates)


class PackedKeys(Sequence[str]):
    """Block keys in the table's own form (32 octets each, as ``pack_keys`` makes them from a
    request body), read as hex strings by whoever needs those: a lookup decoded this way
    creates no string per key, and the table parses nothing again."""

    __slots__ = ("octets",)

    def __init__(self, octets: bytes) -> None:
        self.octets = octets

    def __len__(self) -> int:
        return len(self.octets) // 32

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        n = len(self)
        if not -n <= index < n:
            raise IndexError("block key index out of range")
        start = 32 * (index % n)
        return self.octets[start : start + 32].hex()

    def __iter__(self) -> Iterator[str]:
        octets = self.octets
        return (octets[i : i + 32].hex() for i in range(0, len(octets), 32))


def probed(block_keys: Sequence[str]) -> Sequence[str] | bytes:
    """What a key table probes: packed keys as they are, anything else key by key."""
    return block_keys.octets if isinstance(block_keys, PackedKeys) else block_keys
