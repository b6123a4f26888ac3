"""The replica records of an in-memory Index Service, pure and Clock-injected: TTLs, prefix
lookup, expiry (KVSP 6.1, 6.2).

Records are kept as the JSON the IS serves (``index/wire.py``: with ``ttl_ms`` the TTL granted
at the last publish or refresh), minus the identity members every record of a block shares,
packed (``packed.py``: a skeleton shared by like records, and the digests' octets), plus a
shared ``ReplicaSummary`` for estimates. The blocks of a space are held in a ``KeyTable`` (block
key -> block and its records packed; compiled, or a dict with the same contract), which probes
all keys of a lookup and renders the answer from the packed records in one allocation, never
serialising a record. Each record is one ``StoredReplica`` (``keytable.py``: compiled, its packed
octets inline, 128 octets for a plain record; decision 0026), and a block of one replica is
held as that replica, not a wrapper around it, so most blocks cost one object. Expiry pops a
heap of deadlines, so it costs O(expired), never a scan; refreshes leave stale heap entries
behind, which are skipped when popped and compacted away when they outnumber the live
ones. The heap holds the stored replicas themselves (ordered by deadline), not
``core.deadlines.Deadlines``' key map and tuples: those would add well over 100 octets to each of
millions of records, past the 1 KiB a record may take.
"""

from __future__ import annotations

import heapq
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

from kvsp.core.clock import Clock
from kvsp.core.cost import ReplicaSummary
from kvsp.core.problems import CapacityExhausted
from kvsp.core.records import ReplicaRecord, ReplicaRef
from kvsp.index.keytable import KeyTable, StoredReplica, holder_runs, render_array, untrack
from kvsp.index.packed import MAX_SHAPES, Shape, Skeletons, record_shape
from kvsp.index.puts import RecordShape, SharedPuts
from kvsp.index.rules import IndexLimits
from kvsp.index.wire import (
    ANSWER_END,
    ANSWER_HEAD,
    ANSWER_MIDDLE,
    Space,
    answer_json,
    identity_middle,
    identity_prefix,
    join_array,
    probed,
    record_tail,
)

__all__ = [
    "Block",
    "BlockReplicas",
    "PublishOutcome",
    "ReplicaTable",
    "StoredReplica",
    "array_of",
    "arrays_of",
    "holder_runs",
    "released",
    "summary_of",
    "tail_of",
]


class PublishOutcome(NamedTuple):
    """A published record's outcome: a tuple, as ``wire.batch_json`` renders it, and one
    object for a run of like outcomes (``_stored_new``)."""

    created: bool
    ttl_ms: int


def tail_of(replica: StoredReplica) -> bytes:
    """The record's served JSON tail (what follows its identity members)."""
    record = replica.record
    if record is not None:
        return record_tail(record, record.ttl_ms)
    skeletons = replica.packed_by
    assert skeletons is not None  # a packed record comes with its skeletons
    return skeletons.tail(replica.packed)


def summary_of(replica: StoredReplica) -> ReplicaSummary:
    """The replica's cost summary: the store's, or parsed from the record on first use."""
    if replica.summary is None:
        record = identity_prefix(replica.space, replica.block_key) + tail_of(replica)
        replica.summary = ReplicaSummary.of(ReplicaRecord.parse(record))
    return replica.summary


def released(replica: StoredReplica) -> None:
    """The replica leaves its store: its skeleton is used once less."""
    if replica.packed_by is not None:
        replica.packed_by.release(replica.packed)


def array_of(block: Block) -> bytes:
    """A block's JSON array, as a lookup serves it: rendered from the packed records as the
    key table renders them, or joined from the tails."""
    replicas = block.replicas
    first = replicas[0]
    skeletons = first.packed_by
    if skeletons is not None:
        packed = b"".join(r.packed for r in replicas)
        return render_array(identity_middle(first.space), packed, skeletons.listed)
    return join_array(identity_prefix(first.space, first.block_key), [tail_of(r) for r in replicas])


class BlockReplicas:
    """The live replicas of one block (two or more as a store holds them; any number while it
    changes them)."""

    __slots__ = ("replicas",)

    def __init__(self, replicas: tuple[StoredReplica, ...]) -> None:
        self.replicas = replicas

    @property
    def held(self) -> Block:
        """What the key table holds for this block: its one replica, or this."""
        replicas = self.replicas
        return replicas[0] if len(replicas) == 1 else self

    def find(self, holder: str) -> StoredReplica | None:
        for replica in self.replicas:
            if replica.holder == holder:
                return replica
        return None

    def put(self, replica: StoredReplica) -> StoredReplica | None:
        """Add or replace the holder's replica; the one it replaced, if any."""
        replicas = self.replicas
        for i, r in enumerate(replicas):
            if r.holder == replica.holder:
                self.replicas = (*replicas[:i], *replicas[i + 1 :], replica)
                return r
        self.replicas = (*replicas, replica)
        return None

    def remove(self, holder: str) -> StoredReplica | None:
        """Drop the holder's replica; the one dropped, if any."""
        gone = self.find(holder)
        if gone is not None:
            self.replicas = tuple(r for r in self.replicas if r is not gone)
        return gone


#: what a lookup answers for each matched block, and what a key table holds for it
Block = StoredReplica | BlockReplicas


def arrays_of(blocks: Sequence[Block]) -> list[bytes]:
    """The JSON arrays of the blocks, for ``answer_json``."""
    return [array_of(b) for b in blocks]


class ReplicaTable:
    """All replica records of an in-memory index.

    ``render_at_publish``: a record's JSON is rendered when it is published (a served index
    answers lookups with it, and bytes are smaller than records); an index embedded in a
    process that only reads cost summaries (the simulator) renders it only if ever asked.

    The cyclic collector never walks the records (``untrack``, decision 0025): each space's
    key table, the deadline heap and every block's tuple of replicas are taken out of it, and a
    compiled replica is never in it.
    None of them can be part of a cycle: they reference only strings, numbers, octets, shared
    summaries and (unrendered) records, none of which lead back to them. Kept, a full
    collection walked three objects per record: 0.64 s at 300,000 records."""

    def __init__(self, clock: Clock, limits: IndexLimits, render_at_publish: bool = True) -> None:
        self._clock = clock
        self._limits = limits
        self._render = render_at_publish
        # (compat, scope) -> block_key -> replicas: a lookup resolves its space once.
        self._spaces: dict[Space, KeyTable[Block]] = {}
        self._deadlines: list[StoredReplica] = []
        untrack(self._deadlines)
        self._summaries: dict[ReplicaSummary, ReplicaSummary] = {}
        self._summary_of: dict[Shape, ReplicaSummary] = {}
        self._space_names: dict[Space, Space] = {}
        self._skeletons = Skeletons()
        self._by_scope: dict[str, int] = {}
        self._count = 0
        self.expired_total = 0

    @property
    def count(self) -> int:
        self.expire()
        return self._count

    def counts_by_scope(self) -> dict[str, int]:
        self.expire()
        return dict(self._by_scope)

    def _block(self, space: Space, block_key: str) -> Block | None:
        blocks = self._spaces.get(space)
        return None if blocks is None else blocks.get(block_key)

    def publish(self, record: ReplicaRecord) -> PublishOutcome:
        """Store or refresh (same record, new deadline) one record; 507 past the limit."""
        return self.publish_many([record])[0]

    def publish_many(self, records: Sequence[ReplicaRecord]) -> list[PublishOutcome]:
        """Publish a batch atomically: either every record is stored or none is."""
        now = self._room_for(Counter(r.scope_id for r in records), lambda: records)
        return [self._store(record, now) for record in records]

    def publish_shared(self, puts: SharedPuts) -> list[PublishOutcome]:
        """``publish_many`` of a split batch's records: each packed from its shape's skeleton
        and its identity's octets, never made a record, and a run's records with new blocks
        stored in one call of the key table (a shape whose skeleton is not shared, or a store
        that renders nothing, takes them as records)."""
        if not self._render:
            return self.publish_many(puts.records())
        now = self._room_for(puts.scope_counts(), puts.records)
        outcomes: list[PublishOutcome] = []
        skeletons = self._skeletons
        for run in puts.runs:
            ttl, summary, skeleton = self._shared(run.shape)
            if skeleton is None:
                records = (puts.record(run.shape, i) for i in range(run.start, run.stop))
                outcomes += (self._store(record, now) for record in records)
                continue
            identity = puts.identity(run.start)
            space = self._space(identity[:32].hex(), identity[32:48].hex())
            blocks, head = self._blocks(space), skeletons.head(skeleton)
            holder, expires_at, at = run.shape.publisher, now + ttl, run.start
            while True:  # the records whose blocks are new in one call, the others one by one
                stopped = blocks.put_run(
                    puts.identities,
                    at,
                    run.stop,
                    head,
                    space,
                    holder,
                    expires_at,
                    summary,
                    skeletons,
                    self._deadlines,
                )
                self._stored_new(space[1], head, stopped - at, ttl, outcomes)
                if stopped == run.stop:
                    break
                identity = puts.identity(stopped)
                skeletons.add_uses(head, 1)
                packed = head + identity[48:]
                replica = StoredReplica(space, holder, expires_at, packed, summary, skeletons)
                outcomes.append(self._enter(replica, identity[48:80].hex(), ttl))
                at = stopped + 1
        return outcomes

    def _stored_new(
        self, scope: str, head: bytes, stored: int, ttl: int, outcomes: list[PublishOutcome]
    ) -> None:
        """``stored`` records of skeleton ``head`` were stored as new blocks (``put_run``)."""
        if stored:
            self._skeletons.add_uses(head, stored)
            outcomes += [PublishOutcome(True, ttl)] * stored
            self._added(scope, stored)

    def _room_for(
        self, scopes: Mapping[str, int], records: Callable[[], Iterable[ReplicaRecord]]
    ) -> int:
        """``CapacityExhausted`` unless the records fit: how many each scope has (``scopes``),
        and where that is too many, which of the ``records`` are new (a holder's first of its
        block); the clock reading, after expiry, otherwise."""
        now = self.expire()
        held = self._by_scope.get
        try:  # every record new at most: cannot pass a limit
            self._limits.check_room(self._count, scopes, lambda s: held(s, 0))
        except CapacityExhausted:
            new: Counter[str] = Counter()
            slots = ((r.compat_id, r.scope_id, r.block_key, r.publisher) for r in records())
            for compat, scope, block_key, holder in dict.fromkeys(slots):
                block = self._block((compat, scope), block_key)
                if block is None or all(r.holder != holder for r in block.replicas):
                    new[scope] += 1
            self._limits.check_room(self._count, new, lambda s: held(s, 0))
        return now

    def _shared(self, shape: RecordShape) -> tuple[int, ReplicaSummary, bytes | None]:
        """What every record of a split batch's shape is stored with: its granted TTL, its
        cost summary and its skeleton (None where its records are packed one by one)."""
        record = shape.record
        ttl = min(record.ttl_ms, self._limits.max_ttl_ms)
        summary = self._summary_of.get(shape.text)
        if summary is None:
            summary = self._summary(record, shape.text)
        return ttl, summary, self._skeletons.skeleton(record, ttl, shape.text)

    def _space(self, compat: str, scope: str) -> Space:
        named = (compat, scope)
        return self._space_names.setdefault(named, named)  # one tuple per space, shared

    def _store(self, record: ReplicaRecord, now: int) -> PublishOutcome:
        ttl = min(record.ttl_ms, self._limits.max_ttl_ms)
        space = self._space(record.compat_id, record.scope_id)
        shape = record_shape(record, ttl)
        summary = self._summary_of.get(shape)
        if summary is None:
            summary = self._summary(record, shape)
        holder = sys.intern(record.publisher)
        if self._render:
            packed = self._skeletons.pack_record(record, ttl, shape)
            replica = StoredReplica(space, holder, now + ttl, packed, summary, self._skeletons)
        else:
            unrendered = (
                record if record.ttl_ms == ttl else record.model_copy(update={"ttl_ms": ttl})
            )
            replica = StoredReplica(space, holder, now + ttl, unrendered, summary)
        return self._enter(replica, record.block_key, ttl)

    def _blocks(self, space: Space) -> KeyTable[Block]:
        """The key table of the space's blocks, made for its first."""
        blocks = self._spaces.get(space)
        if blocks is None:
            blocks = self._spaces[space] = KeyTable(identity_middle(space), self._skeletons.listed)
            untrack(blocks)
        return blocks

    def _enter(self, replica: StoredReplica, block_key: str, ttl: int) -> PublishOutcome:
        """Hold the replica for its block in its space: a new block's one, or in place of its
        holder's earlier one."""
        space = replica.space
        blocks = self._blocks(space)
        held = blocks.get(block_key)
        if held is None:  # most publishes: a new block, held as its one replica
            replicas: tuple[StoredReplica, ...] = (replica,)
            created = True
        else:
            block = BlockReplicas(held.replicas)
            replaced = block.put(replica)
            if replaced is not None:
                released(replaced)
            replicas, created = block.replicas, replaced is None
        self._set(blocks, block_key, replicas)
        heapq.heappush(self._deadlines, replica)
        self._added(space[1], int(created))
        return PublishOutcome(created, ttl)

    def _added(self, scope: str, created: int) -> None:
        """Deadlines were pushed and ``created`` records of ``scope`` are new: counted, and
        the heap compacted once its stale entries outnumber the live ones."""
        if created:
            self._count += created
            self._by_scope[scope] = self._by_scope.get(scope, 0) + created
        if len(self._deadlines) > 2 * self._count + 1024:
            self._compact()

    def _summary(self, record: ReplicaRecord, shape: Shape) -> ReplicaSummary:
        """The cost summary of records of ``shape``, built once and shared by equal ones; the
        memo is bounded as the skeletons' shapes are, so a publisher that varies every record
        (its sizes, its TTLs) leaves no more than ``MAX_SHAPES`` behind."""
        if len(self._summary_of) >= MAX_SHAPES:
            self._summary_of.clear()
            self._summaries.clear()
        built = ReplicaSummary.of(record)
        summary = self._summary_of[shape] = self._summaries.setdefault(built, built)
        return summary

    def _set(self, blocks: KeyTable[Block], key: str, replicas: tuple[StoredReplica, ...]) -> None:
        """(Re)enter a changed block's replicas with their records packed, which lookups
        render. A block of one replica is held as the replica (96 octets fewer a block), its
        payload the replica itself (its packed octets, not a copy)."""
        if len(replicas) == 1:
            (only,) = replicas
            blocks.put(key, only, only if self._render else None)
            return
        held = BlockReplicas(replicas)
        untrack(held, replicas)
        blocks.put(key, held, b"".join(r.packed for r in replicas) if self._render else None)

    def withdraw(self, ref: ReplicaRef) -> bool:
        self.expire()
        return self._remove((ref.compat_id, ref.scope_id), ref.block_key, ref.publisher)

    def _remove(self, space: Space, block_key: str, holder: str) -> bool:
        blocks = self._spaces.get(space)
        held = None if blocks is None else blocks.get(block_key)
        if blocks is None or held is None:
            return False
        block = BlockReplicas(held.replicas)
        gone = block.remove(holder)
        if gone is None:
            return False
        released(gone)
        if not block.replicas:
            blocks.pop(block_key)
            if not blocks:
                del self._spaces[space]
        else:
            self._set(blocks, block_key, block.replicas)
        self._count -= 1
        scope = space[1]
        remaining = self._by_scope[scope] - 1
        if remaining:
            self._by_scope[scope] = remaining
        else:
            del self._by_scope[scope]
        return True

    def expire(self) -> int:
        """Drop every record past its deadline; returns the clock reading used."""
        now = self._clock.now_ms()
        deadlines = self._deadlines
        while deadlines and deadlines[0].expires_at <= now:
            due = heapq.heappop(deadlines)
            block_key = due.block_key
            block = self._block(due.space, block_key)
            # a refresh replaced the replica object: this heap entry is stale
            if block is not None and due in block.replicas:
                self._remove(due.space, block_key, due.holder)
                self.expired_total += 1
        return now

    def _compact(self) -> None:
        self._deadlines = [
            replica
            for blocks in self._spaces.values()
            for block in blocks.values()
            for replica in block.replicas
        ]
        untrack(self._deadlines)
        heapq.heapify(self._deadlines)

    def lookup(self, compat: str, scope: str, block_keys: Sequence[str]) -> list[Block]:
        """Replicas of the leading keys that have any, stopping at the first key without one."""
        self.expire()
        blocks = self._spaces.get((compat, scope))
        return [] if blocks is None else blocks.prefix(probed(block_keys))

    def answer(self, compat: str, scope: str, block_keys: Sequence[str]) -> tuple[int, bytes]:
        """The matched count and the whole lookup answer without estimates, as ``answer_json``
        renders it, rendered from the blocks' packed records in one allocation."""
        self.expire()
        blocks = self._spaces.get((compat, scope))
        if blocks is None:
            return 0, answer_json(())
        return blocks.join_prefix(
            probed(block_keys), ANSWER_HEAD, ANSWER_MIDDLE, b",", ANSWER_END + b"]}"
        )

    def holders(
        self, compat: str, scope: str, block_keys: Sequence[str]
    ) -> tuple[int, list[tuple[str, int]]]:
        """The matched count and ``holder_runs`` of the matched blocks, counted by the key
        table as it walks them (no list of them is made)."""
        self.expire()
        blocks = self._spaces.get((compat, scope))
        return (0, []) if blocks is None else blocks.holder_runs(probed(block_keys))

    def answered(
        self, compat: str, scope: str, block_keys: Sequence[str], estimates: bytes
    ) -> bytes:
        """The answer to a ``lookup`` just made, with its estimates: nothing expires first, so
        it holds the blocks that lookup found."""
        blocks = self._spaces.get((compat, scope))
        if blocks is None:
            return answer_json((), estimates)
        tail = b"%s%s]}" % (ANSWER_END, estimates)
        return blocks.join_prefix(probed(block_keys), ANSWER_HEAD, ANSWER_MIDDLE, b",", tail)[1]
