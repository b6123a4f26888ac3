"""The block-key table of the Index Service's memory store, and the key checks of its lookup
decoder: the compiled ``_keytable`` where it was built, otherwise ``DictKeyTable`` and plain
Python checks with the same contract (slower: about 0.8 us a probe under load, against the
compiled table's batched probes; docs/decisions/0006). A machine without a C compiler installs
and runs kvsp with the fallback; ``COMPILED`` says which one this process uses.

The contract (tests/index/test_keytable.py holds both to it): keys are 64 lowercase hex digits
(str), or for lookups bytes of packed keys, 32 octets each; a value is any object but None; a
payload is bytes or None: a block's records packed (``packed.py``), the first of them of its key
(the compiled table reads the key there rather than hold it twice; decision 0026), which
``join_prefix`` renders as the block's JSON array with the table's identity members
(``identity_middle``), from the skeletons in the list the table was made with
(``Skeletons.listed``, shared and read at each join); ``prefix``, ``join_prefix`` and
``holder_runs`` (each holder of the first block with the leading blocks it holds, what a router
weighs: ``holder_runs`` here over the values of ``prefix``) stop at the first key not held;
``pack_keys`` turns a request's raw JSON array of distinct keys into packed keys, or answers
None for anything it does not take as it is (the caller then decodes it the slow way, which
says what is wrong): the fallback always answers None. ``render_array`` renders one block's
payload as ``join_prefix`` does, for answers assembled in Python. ``untrack`` takes
objects that are never part of a reference cycle out of the cyclic collector, so its full
collections do not walk millions of stored records (decision 0025); the fallback leaves them
tracked.
``StoredReplica`` is one record as the memory store holds it (decision 0026): compiled, one
object of 128 octets for a plain record with its packed octets inline, never tracked by the
collector; the fallback, ``SlotsReplica``, a class with slots and the octets as bytes.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, cast

from kvsp.index import packed
from kvsp.index.puts import IDENTITY_OCTETS

if TYPE_CHECKING:
    from kvsp.core.cost import ReplicaSummary
    from kvsp.core.records import ReplicaRecord
    from kvsp.index.packed import Skeletons

__all__ = [
    "COMPILED",
    "DictKeyTable",
    "KeyTable",
    "SlotsReplica",
    "StoredReplica",
    "check_keys",
    "holder_runs",
    "is_hex",
    "pack_keys",
    "render_array",
    "untrack",
]

V = TypeVar("V")


class _Held(Protocol):
    """What a key table holds for a block: its replicas, each naming its holder."""

    @property
    def replicas(self) -> Sequence[_Replica]: ...


class _Replica(Protocol):
    @property
    def holder(self) -> str: ...


def holder_runs(blocks: Sequence[_Held]) -> list[tuple[str, int]]:
    """Each holder of the first block with the number of leading blocks it holds, most first
    (then by URL): what a router weighs, without the records."""
    runs: dict[str, int] = {}
    for i, block in enumerate(blocks):
        for replica in block.replicas:
            if runs.get(replica.holder, 0) == i:
                runs[replica.holder] = i + 1
    return sorted(runs.items(), key=lambda run: (-run[1], run[0]))


_KEY = re.compile(r"[0-9a-f]{64}")
_HEX = re.compile(r"(?:[0-9a-f]{8})*")
_BAD_KEY = "block key must be 64 lowercase hex digits"


def _checked(key: object) -> str:
    if not isinstance(key, str):
        raise TypeError(f"block key must be str, not {type(key).__name__}")
    if _KEY.fullmatch(key) is None:
        raise ValueError(_BAD_KEY)
    return key


def _keys_of(keys: Sequence[str] | bytes) -> list[str]:
    if isinstance(keys, bytes):
        if len(keys) % 32:
            raise ValueError("packed keys are 32 octets each")
        return [keys[i : i + 32].hex() for i in range(0, len(keys), 32)]
    return [_checked(key) for key in keys]


class SlotsReplica:
    """``_keytable.StoredReplica``'s contract as a class with slots."""

    __slots__ = ("_origin", "_packed", "expires_at", "holder", "space", "summary")

    def __init__(
        self,
        space: tuple[str, str],
        holder: str,
        expires_at: int,
        record: bytes | ReplicaRecord,
        summary: ReplicaSummary | None = None,
        packed_by: Skeletons | None = None,
    ) -> None:
        if isinstance(record, bytes) is (packed_by is None):
            raise TypeError("a packed record comes with its skeletons, and only a packed one")
        if isinstance(record, bytes) and len(record) < 36:
            raise ValueError("a packed record holds a skeleton number and a key")
        self.space = space
        self.holder = holder
        self.expires_at = expires_at
        self.summary = summary
        self._packed = record if isinstance(record, bytes) else b""
        self._origin = packed_by if isinstance(record, bytes) else record

    def __lt__(self, other: SlotsReplica) -> bool:
        return self.expires_at < other.expires_at

    @property
    def packed(self) -> bytes:
        if not self._packed:
            raise LookupError("this replica is not packed")
        return self._packed

    @property
    def packed_by(self) -> Skeletons | None:
        return self._origin if self._packed else None  # type: ignore[return-value]

    @property
    def record(self) -> ReplicaRecord | None:
        return None if self._packed else self._origin  # type: ignore[return-value]

    @property
    def block_key(self) -> str:
        record = self.record
        return packed.block_key_of(self._packed) if record is None else record.block_key

    @property
    def replicas(self) -> tuple[SlotsReplica, ...]:
        return (self,)


class DictKeyTable(Generic[V]):
    """``_keytable.KeyTable``'s contract over a dict."""

    def __init__(self, identity: bytes, skeletons: list[bytes | None], /) -> None:
        if not isinstance(identity, bytes) or not isinstance(skeletons, list):
            raise TypeError("KeyTable(identity, skeletons) takes bytes and a list")
        self._identity = identity
        self._skeletons = skeletons
        self._entries: dict[str, tuple[V, bytes | None]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str, /) -> V | None:
        entry = self._entries.get(_checked(key))
        return None if entry is None else entry[0]

    def put(self, key: str, value: V, payload: bytes | SlotsReplica | None, /) -> None:
        checked = _checked(key)
        if value is None:
            raise ValueError("a KeyTable value cannot be None")
        if isinstance(payload, SlotsReplica) and payload.record is None:
            payload = payload.packed
        elif payload is not None and not isinstance(payload, bytes):
            raise TypeError("payload must be bytes, a packed StoredReplica or None")
        if payload is not None and packed.block_key_of(payload) != checked:
            raise ValueError("a payload's first record must be of its key")
        self._entries[checked] = (value, payload)

    def put_run(
        self,
        identities: bytes,
        start: int,
        stop: int,
        head: bytes,
        space: tuple[str, str],
        holder: str,
        expires_at: int,
        summary: ReplicaSummary,
        skeletons: Skeletons,
        deadlines: list[SlotsReplica],
        /,
    ) -> int:
        for i in range(start, stop):
            identity = identities[IDENTITY_OCTETS * i : IDENTITY_OCTETS * (i + 1)]
            key = identity[48:80].hex()
            if key in self._entries:
                return i
            packed = head + identity[48:]
            replica = SlotsReplica(space, holder, expires_at, packed, summary, skeletons)
            self._entries[key] = (cast(V, replica), packed)
            heapq.heappush(deadlines, replica)
        return stop

    def pop(self, key: str, /) -> V | None:
        entry = self._entries.pop(_checked(key), None)
        return None if entry is None else entry[0]

    def _leading(self, keys: Sequence[str] | bytes) -> list[tuple[V, bytes | None]]:
        out = []
        for key in _keys_of(keys):
            entry = self._entries.get(key)
            if entry is None:
                break
            out.append(entry)
        return out

    def prefix(self, keys: Sequence[str] | bytes, /) -> list[V]:
        return [value for value, _ in self._leading(keys)]

    def join_prefix(
        self, keys: Sequence[str] | bytes, head: bytes, middle: bytes, sep: bytes, tail: bytes, /
    ) -> tuple[int, bytes]:
        arrays = []
        for _, payload in self._leading(keys):
            if payload is None:
                raise LookupError("a matched key has no payload")
            arrays.append(packed.render_array(self._identity, payload, self._skeletons))
        matched = len(arrays)
        return matched, b"%s%d%s%s%s" % (head, matched, middle, sep.join(arrays), tail)

    def holder_runs(self, keys: Sequence[str] | bytes, /) -> tuple[int, list[tuple[str, int]]]:
        blocks = self.prefix(keys)
        return len(blocks), holder_runs(blocks)  # type: ignore[arg-type]

    def values(self) -> list[V]:
        return [value for value, _ in self._entries.values()]


def _check_keys(keys: Sequence[str], /) -> None:
    for n, key in enumerate(keys):
        if not isinstance(key, str) or _KEY.fullmatch(key) is None:
            raise ValueError(f"block key {n} is not 64 lowercase hex digits")


def _is_hex(text: str, /) -> bool:
    if not isinstance(text, str):
        raise TypeError(f"expected str, not {type(text).__name__}")
    return _HEX.fullmatch(text) is not None


def _pack_keys(json: bytes | memoryview | object, /) -> bytes | None:
    return None


def _untrack(*objects: object) -> None:
    """Pure Python cannot take an object out of the collector: the objects stay tracked."""


try:
    from kvsp.index._keytable import (
        KeyTable,
        StoredReplica,
        check_keys,
        is_hex,
        pack_keys,
        render_array,
        untrack,
    )

    COMPILED = True
except ImportError:  # built without a C compiler
    KeyTable = DictKeyTable  # type: ignore[assignment,misc]
    StoredReplica = SlotsReplica  # type: ignore[assignment,misc]
    check_keys = _check_keys
    is_hex = _is_hex
    pack_keys = _pack_keys
    untrack = _untrack
    render_array = packed.render_array
    COMPILED = False
