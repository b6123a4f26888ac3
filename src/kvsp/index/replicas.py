"""The replica records of an in-memory Index Service, pure and Clock-injected: TTLs, prefix
lookup, expiry (KVSP 6.1, 6.2).

Records are kept as the JSON the IS serves (``index/wire.py``: with ``ttl_ms`` the TTL granted
at the last publish or refresh), minus the identity members every record of a block shares,
plus a shared ``ReplicaSummary`` for estimates; each block caches the JSON array of its
replicas, so a lookup joins ready octets and never serialises a record. The blocks of a space
are held in a ``KeyTable`` (block key -> block and its JSON array; compiled, or a dict with the
same contract), which probes all keys of a lookup and assembles the answer in one copy. Expiry
pops a heap of deadlines, so it costs O(expired), never a scan; refreshes leave stale heap
entries behind, which are skipped when popped and compacted away when they outnumber the live
ones. The heap holds the stored replicas themselves (ordered by deadline), not
``core.deadlines.Deadlines``' key map and tuples: those would add well over 100 octets to each of
millions of records, past the 1 KiB a record may take.
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from kvsp.core.clock import Clock
from kvsp.core.cost import ReplicaSummary
from kvsp.core.problems import CapacityExhausted
from kvsp.core.records import ReplicaRecord, ReplicaRef
from kvsp.index.keytable import KeyTable, untrack
from kvsp.index.rules import IndexLimits
from kvsp.index.wire import (
    ANSWER_END,
    ANSWER_HEAD,
    ANSWER_MIDDLE,
    Space,
    answer_json,
    identity_prefix,
    join_array,
    probed,
    record_tail,
    split_array,
)

__all__ = [
    "BlockReplicas",
    "PublishOutcome",
    "ReplicaTable",
    "StoredReplica",
    "arrays_of",
    "holder_runs",
]


@dataclass(frozen=True, slots=True)
class PublishOutcome:
    created: bool
    ttl_ms: int


class StoredReplica:
    """One record as stored: where it belongs, its holder (canonical), its deadline on the
    store's clock, the tail of its served JSON (or the record, with its granted TTL, to render
    it from when first served, or ``None`` once its block's array holds it: see
    ``BlockReplicas.release_tails``), and its cost summary (parsed on first use when the store
    has none). Replicas order by deadline, so the expiry heap holds them directly."""

    __slots__ = ("_tail", "block_key", "expires_at", "holder", "space", "summary")

    def __init__(
        self,
        space: Space,
        block_key: str,
        holder: str,
        expires_at: int,
        tail: bytes | ReplicaRecord,
        summary: ReplicaSummary | None = None,
    ) -> None:
        self.space = space
        self.block_key = block_key
        self.holder = holder
        self.expires_at = expires_at
        self._tail: bytes | ReplicaRecord | None = tail
        self.summary = summary

    def __lt__(self, other: StoredReplica) -> bool:
        return self.expires_at < other.expires_at

    @property
    def tail(self) -> bytes:
        tail = self._tail
        if isinstance(tail, bytes):
            return tail
        if tail is None:
            raise LookupError("this replica's JSON is held in its block's array")
        rendered = self._tail = record_tail(tail, tail.ttl_ms)
        return rendered

    def get_summary(self) -> ReplicaSummary:
        if self.summary is None:
            record = identity_prefix(self.space, self.block_key) + self.tail
            self.summary = ReplicaSummary.of(ReplicaRecord.parse(record))
        return self.summary


class BlockReplicas:
    """The live replicas of one block and, cached, the JSON array a lookup serves for it."""

    __slots__ = ("_rendered", "replicas")

    def __init__(self, replicas: tuple[StoredReplica, ...]) -> None:
        self.replicas = replicas
        self._rendered: bytes | None = None

    def _prefix(self) -> bytes:
        first = self.replicas[0]
        return identity_prefix(first.space, first.block_key)

    def rendered(self) -> bytes:
        if self._rendered is None:
            prefix = self._prefix()
            self._rendered = join_array(prefix, [r.tail for r in self.replicas])
        return self._rendered

    def release_tails(self) -> None:
        """Let the rendered array be the only copy of the replicas' JSON (a store that keeps
        the array anyway saves a third of its memory). The tails are cut back out of the array
        before the replicas change (``split_array``)."""
        self.rendered()
        for replica in self.replicas:
            replica._tail = None

    def _restore_tails(self) -> None:
        if self._rendered is None or self.replicas[0]._tail is not None:
            return
        tails = split_array(self._prefix(), self._rendered)
        for replica, tail in zip(self.replicas, tails, strict=True):
            replica._tail = tail

    def find(self, holder: str) -> StoredReplica | None:
        for replica in self.replicas:
            if replica.holder == holder:
                return replica
        return None

    def put(self, replica: StoredReplica) -> bool:
        """Add or replace the holder's replica; True if it is new."""
        self._restore_tails()
        replicas = self.replicas
        self._rendered = None
        for i, r in enumerate(replicas):
            if r.holder == replica.holder:
                self.replicas = (*replicas[:i], *replicas[i + 1 :], replica)
                return False
        self.replicas = (*replicas, replica)
        return True

    def remove(self, holder: str) -> bool:
        kept = tuple(r for r in self.replicas if r.holder != holder)
        if len(kept) == len(self.replicas):
            return False
        self._restore_tails()
        self.replicas = kept
        self._rendered = None
        return True


def arrays_of(blocks: Sequence[BlockReplicas]) -> list[bytes]:
    """The JSON arrays of the blocks, for ``answer_json``."""
    return [b.rendered() for b in blocks]


def holder_runs(blocks: Sequence[BlockReplicas]) -> list[tuple[str, int]]:
    """Each holder of the first block with the number of leading blocks it holds, most first
    (then by URL): what a router weighs, without the records."""
    runs: dict[str, int] = {}
    for i, block in enumerate(blocks):
        for replica in block.replicas:
            if runs.get(replica.holder, 0) == i:
                runs[replica.holder] = i + 1
    return sorted(runs.items(), key=lambda run: (-run[1], run[0]))


class ReplicaTable:
    """All replica records of an in-memory index.

    ``render_at_publish``: a record's JSON is rendered when it is published (a served index
    answers lookups with it, and bytes are smaller than records); an index embedded in a
    process that only reads cost summaries (the simulator) renders it only if ever asked.

    The cyclic collector never walks the records (``untrack``, decision 0025): each space's
    key table, the deadline heap, every block, its tuple and its replicas are taken out of it.
    None of them can be part of a cycle: they reference only strings, numbers, octets, shared
    summaries and (unrendered) records, none of which lead back to them. Kept, a full
    collection walked three objects per record: 0.64 s at 300,000 records."""

    def __init__(self, clock: Clock, limits: IndexLimits, render_at_publish: bool = True) -> None:
        self._clock = clock
        self._limits = limits
        self._render = render_at_publish
        # (compat, scope) -> block_key -> replicas: a lookup resolves its space once.
        self._spaces: dict[Space, KeyTable[BlockReplicas]] = {}
        self._deadlines: list[StoredReplica] = []
        untrack(self._deadlines)
        self._summaries: dict[ReplicaSummary, ReplicaSummary] = {}
        self._summary_of: dict[tuple[object, ...], ReplicaSummary] = {}
        self._space_names: dict[Space, Space] = {}
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

    def _block(self, space: Space, block_key: str) -> BlockReplicas | None:
        blocks = self._spaces.get(space)
        return None if blocks is None else blocks.get(block_key)

    def publish(self, record: ReplicaRecord) -> PublishOutcome:
        """Store or refresh (same record, new deadline) one record; 507 past the limit."""
        return self.publish_many([record])[0]

    def publish_many(self, records: Sequence[ReplicaRecord]) -> list[PublishOutcome]:
        """Publish a batch atomically: either every record is stored or none is."""
        now = self.expire()
        held = self._by_scope.get
        try:  # every record new at most: cannot pass a limit
            self._limits.check_room(
                self._count, (r.scope_id for r in records), lambda s: held(s, 0)
            )
        except CapacityExhausted:
            new = set()
            for r in records:
                holder = r.publisher
                block = self._block((r.compat_id, r.scope_id), r.block_key)
                if block is None or block.find(holder) is None:
                    new.add((r.compat_id, r.scope_id, r.block_key, holder))
            self._limits.check_room(self._count, (n[1] for n in new), lambda s: held(s, 0))
        return [self._store(record, now) for record in records]

    def _store(self, record: ReplicaRecord, now: int) -> PublishOutcome:
        ttl = min(record.ttl_ms, self._limits.max_ttl_ms)
        named = (record.compat_id, record.scope_id)
        space = self._space_names.setdefault(named, named)  # one tuple per space, shared
        blocks = self._spaces.get(space)
        if blocks is None:
            blocks = self._spaces[space] = KeyTable()
            untrack(blocks)
        # the layer count follows from the residency unless the layer digests name it
        layers = None if record.layer_digests is None else len(record.layer_digests)
        residency = tuple((r.tier, r.layers, r.read_mbit_per_s) for r in record.residency)
        summary_key = (record.holder, record.size, layers, residency)
        summary = self._summary_of.get(summary_key)
        if summary is None:  # equal records share one summary, built once
            built = ReplicaSummary.of(record)
            summary = self._summary_of[summary_key] = self._summaries.setdefault(built, built)
        block = blocks.get(record.block_key)
        if block is None:
            block = BlockReplicas(())
            block_key = record.block_key
        else:
            block_key = block.replicas[0].block_key  # one key object per block, shared
        if self._render:
            tail: bytes | ReplicaRecord = record_tail(record, ttl)
        else:
            tail = record if record.ttl_ms == ttl else record.model_copy(update={"ttl_ms": ttl})
        replica = StoredReplica(
            space, block_key, sys.intern(record.publisher), now + ttl, tail, summary
        )
        created = block.put(replica)
        self._set(blocks, block)
        heapq.heappush(self._deadlines, replica)
        if created:
            self._count += 1
            self._by_scope[record.scope_id] = self._by_scope.get(record.scope_id, 0) + 1
        if len(self._deadlines) > 2 * self._count + 1024:
            self._compact()
        return PublishOutcome(created, ttl)

    def _set(self, blocks: KeyTable[BlockReplicas], block: BlockReplicas) -> None:
        """(Re)enter a changed block with its JSON array, which lookups join."""
        untrack(block, block.replicas, *block.replicas)
        if self._render:
            block.release_tails()
            blocks.put(block.replicas[0].block_key, block, block.rendered())
        else:
            blocks.put(block.replicas[0].block_key, block, None)

    def withdraw(self, ref: ReplicaRef) -> bool:
        self.expire()
        return self._remove((ref.compat_id, ref.scope_id), ref.block_key, ref.publisher)

    def _remove(self, space: Space, block_key: str, holder: str) -> bool:
        blocks = self._spaces.get(space)
        block = None if blocks is None else blocks.get(block_key)
        if blocks is None or block is None or not block.remove(holder):
            return False
        if not block.replicas:
            blocks.pop(block_key)
            if not blocks:
                del self._spaces[space]
        else:
            self._set(blocks, block)
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
            block = self._block(due.space, due.block_key)
            # a refresh replaced the replica object: this heap entry is stale
            if block is not None and block.find(due.holder) is due:
                self._remove(due.space, due.block_key, due.holder)
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

    def lookup(self, compat: str, scope: str, block_keys: Sequence[str]) -> list[BlockReplicas]:
        """Replicas of the leading keys that have any, stopping at the first key without one."""
        self.expire()
        blocks = self._spaces.get((compat, scope))
        return [] if blocks is None else blocks.prefix(probed(block_keys))

    def answer(self, compat: str, scope: str, block_keys: Sequence[str]) -> tuple[int, bytes]:
        """The matched count and the whole lookup answer without estimates, as ``answer_json``
        renders it, assembled from the blocks' cached arrays in one copy."""
        self.expire()
        blocks = self._spaces.get((compat, scope))
        if blocks is None:
            return 0, answer_json(())
        return blocks.join_prefix(
            probed(block_keys), ANSWER_HEAD, ANSWER_MIDDLE, b",", ANSWER_END + b"]}"
        )
