"""A publish batch's records split into what each has alone and what it shares with others
(decision 0030), pure.

A holder's batch is records that differ in their identity (Compatibility ID, scope, block key)
and replica digest and, mostly, in nothing else. ``split_puts`` (``_puts.c``) scans a plain
``POST replicas`` body once: each record's identity checked and decoded, the text of its other
members (its shape) kept as written. Each distinct shape is validated once, by parsing it with
an identity as a whole ``ReplicaRecord``: no check of a record ties its identity to the rest
(the one that would, a digest against its layer digests, keeps a record from being split), so
the shape is valid for every identity. ``RecordShapes`` remembers the shapes it validated, so a
holder's next batches parse none. Without the compiled splitter, or for any body it does not
split (an escape, a ``delete``, a record with layer digests, a shape longer than
``MAX_SHAPE_OCTETS``, anything malformed), callers parse the body the slow way, which refuses
what is wrong with a precise error.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass

from kvsp.core.problems import RecordError
from kvsp.core.records import MAX_BATCH_ENTRIES, ReplicaRecord


def _split_nothing(body: bytes, /) -> tuple[bytes, list[tuple[bytes, int]]] | None:
    return None


try:
    from kvsp.index._puts import split_puts
except ImportError:  # built without a C compiler: every batch is parsed whole
    split_puts = _split_nothing


__all__ = [
    "IDENTITY_OCTETS",
    "MAX_REMEMBERED",
    "MAX_SHAPE_OCTETS",
    "RecordShape",
    "RecordShapes",
    "Run",
    "SharedPuts",
    "split_puts",
]

#: a split record's identity: Compatibility ID (32 octets), scope (16), block key (32), digest
IDENTITY_OCTETS = 112
#: shapes remembered at most (a holder publishes a few; each is a record and its text)
MAX_REMEMBERED = 1024
#: the longest shape split (a holder's is about 350 octets): a longer one, its text a key of
#: the store's memos too, would let a publisher pin megabytes a shape; its batch is parsed whole
MAX_SHAPE_OCTETS = 4096


@dataclass(frozen=True, slots=True, eq=False)
class RecordShape:
    """What the records of one shape share: its text (the JSON object of their members but
    the identity), a record of that shape (validated, with the identity it was checked with)
    and its publisher, interned (every replica of the shape names it). Compared and hashed
    as the object: one text is one shape."""

    text: bytes
    record: ReplicaRecord
    publisher: str


def _identity_members(identity: bytes) -> dict[str, str]:
    return {
        "compat_id": identity[:32].hex(),
        "scope_id": identity[32:48].hex(),
        "block_key": identity[48:80].hex(),
        "digest": "sha-256:" + identity[80:].hex(),
    }


def _validated(identity: bytes, text: bytes) -> RecordShape:
    """The shape's record with ``identity``, parsed whole; ``RecordError`` if it is not one."""
    members = _identity_members(identity)
    head = ",".join(f'"{name}":"{value}"' for name, value in members.items()).encode()
    record = ReplicaRecord.parse(b"{" + head + (b"," + text[1:] if len(text) > 2 else b"}"))
    return RecordShape(text, record, sys.intern(record.publisher))


@dataclass(frozen=True, slots=True)
class Run:
    """Consecutive records of a split batch of one shape and one space (Compatibility ID and
    scope): those from ``start`` to before ``stop``."""

    shape: RecordShape
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class SharedPuts:
    """The records of a split batch: ``identities`` (``IDENTITY_OCTETS`` each), in ``runs``
    of one shape and space (a holder's batch is one run)."""

    identities: bytes
    runs: list[Run]

    def __len__(self) -> int:
        return len(self.identities) // IDENTITY_OCTETS

    def identity(self, index: int) -> bytes:
        return self.identities[IDENTITY_OCTETS * index : IDENTITY_OCTETS * (index + 1)]

    def record(self, shape: RecordShape, index: int) -> ReplicaRecord:
        """Record ``index`` (of ``shape``) as the batch wrote it, made only where a store
        needs the whole of it."""
        return shape.record.model_copy(update=_identity_members(self.identity(index)))

    def records(self) -> list[ReplicaRecord]:
        return [self.record(r.shape, i) for r in self.runs for i in range(r.start, r.stop)]

    def scope(self, run: Run) -> str:
        at = IDENTITY_OCTETS * run.start
        return self.identities[at + 32 : at + 48].hex()

    def scope_counts(self) -> Counter[str]:
        """How many records each scope has."""
        counts: Counter[str] = Counter()
        for run in self.runs:
            counts[self.scope(run)] += run.stop - run.start
        return counts

    def holders(self) -> list[tuple[str, str]]:
        """Each distinct scope and publisher, in order (what a batch is authorized by)."""
        return list(dict.fromkeys((self.scope(run), run.shape.publisher) for run in self.runs))


class RecordShapes:
    """The shapes validated so far, by their text, at most ``MAX_REMEMBERED`` (forgotten all
    at once past it: a publisher that varies every record only costs itself parses)."""

    def __init__(self) -> None:
        self._known: dict[bytes, RecordShape] = {}

    def split(self, body: bytes) -> SharedPuts | None:
        """The batch's records split, each shape validated; None where the body is not split
        or a shape is not valid (the caller's whole parse then says why)."""
        split = split_puts(body)
        if split is None or len(split[0]) > IDENTITY_OCTETS * MAX_BATCH_ENTRIES:
            return None
        identities, texts = split
        known, runs, start = self._known, [], 0
        shape: RecordShape | None = None
        for text, count in texts:
            if shape is None or text is not shape.text:  # runs of one text share the object
                if len(text) > MAX_SHAPE_OCTETS:
                    return None
                at = IDENTITY_OCTETS * start
                shape = known.get(text) or self._learn(identities[at : at + IDENTITY_OCTETS], text)
                if shape is None:
                    return None
            runs.append(Run(shape, start, start + count))
            start += count
        return SharedPuts(identities, runs)

    def _learn(self, identity: bytes, text: bytes) -> RecordShape | None:
        try:
            shape = _validated(identity, text)
        except RecordError:
            return None
        if len(self._known) >= MAX_REMEMBERED:
            self._known.clear()
        self._known[text] = shape
        return shape
