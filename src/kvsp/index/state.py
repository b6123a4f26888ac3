"""Index Service state, pure and Clock-injected: replica records with TTLs, prefix lookup,
instance statuses with epoch rules, and who may do what (KVSP 6.1, 6.2, 6.3, 6.4).

Records are kept as the JSON the IS serves (with ``ttl_ms`` the TTL granted at the last
publish or refresh), minus the identity members every record of a block shares, plus a shared
``ReplicaSummary`` for estimates; each block caches the JSON array of its replicas, so a lookup
joins ready octets and never serialises a record. The blocks of a space are held in a compiled
``KeyTable`` (block key -> block and its JSON array), which probes all keys of a lookup with
overlapping memory accesses and assembles the answer in one copy. Expiry pops
a heap of deadlines, so it costs O(expired), never a scan; refreshes leave stale heap entries
behind, which are skipped when popped and compacted away when they outnumber the live ones.
"""

from __future__ import annotations

import heapq
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import overload

from kvsp.auth import Principal, Role, authorize
from kvsp.core.clock import Clock
from kvsp.core.cost import FetchPlanner, ReplicaSummary, recompute_us
from kvsp.core.problems import CapacityExhausted, RecordError, StaleEpoch
from kvsp.core.records import (
    InstanceStatusRecord,
    ReplicaRecord,
    ReplicaRef,
    TargetEstimate,
)
from kvsp.core.urls import canonical_url
from kvsp.index.keytable import KeyTable
from kvsp.quotas import Quotas

__all__ = [
    "LOOKUP_ROLES",
    "PUBLISH_ROLES",
    "STATUS_RETENTION_MS",
    "STATUS_ROLES",
    "BlockReplicas",
    "IndexLimits",
    "PackedKeys",
    "PublishOutcome",
    "ReplicaTable",
    "Space",
    "StatusTable",
    "StoredReplica",
    "answer_json",
    "authorize_lookup",
    "authorize_publish",
    "authorize_status",
    "authorize_withdraw",
    "check_path",
    "estimate_targets",
    "identity_prefix",
    "record_tail",
    "render_blocks",
]

PUBLISH_ROLES = (Role.HOLDER, Role.INSTANCE)
#: How long the highest epoch of a silent instance is remembered.
STATUS_RETENTION_MS = 86_400_000
LOOKUP_ROLES = (Role.CONTROLLER, Role.INSTANCE, Role.HOLDER, Role.CLIENT)
STATUS_ROLES = (Role.INSTANCE, Role.CONTROLLER)


@dataclass(frozen=True, slots=True)
class IndexLimits:
    """Bounds an operator sets: the TTL cap (6.1) and the record count past which publishing
    answers 507 instead of growing without bound."""

    max_ttl_ms: int = 600_000
    max_records: int = 5_000_000
    max_instances: int = 65_536
    #: Compatibility Descriptors holders and instances may register (KVSP 4.1)
    max_descriptors: int = 4096
    #: records one scope may have where the quotas set none: one tenant cannot fill the index
    max_scope_records: int = 1_000_000
    quotas: Quotas = field(default_factory=Quotas)

    def check_room(self, total: int, new: Iterable[str], held: Callable[[str], int]) -> None:
        """``CapacityExhausted`` (naming the limit) unless records of the scopes ``new`` (one
        entry per new record) fit beside ``total`` records, ``held(scope)`` of each scope."""
        per_scope = Counter(new)
        added = sum(per_scope.values())
        if total + added > self.max_records:
            raise CapacityExhausted(
                f"the index holds {total} records; {added} more would pass the limit "
                f"of {self.max_records}"
            )
        for scope, count in per_scope.items():
            most = self.quotas.limit(scope, "records", self.max_scope_records)
            if held(scope) + count > most:
                raise CapacityExhausted(
                    f"scope {scope} has {held(scope)} records; {count} more would pass its "
                    f"records quota of {most}"
                )


@dataclass(frozen=True, slots=True)
class PublishOutcome:
    created: bool
    ttl_ms: int


Space = tuple[str, str]
"""(compat_id, scope_id): the Block Keys of one space never collide with another's."""


def identity_prefix(space: Space, block_key: str) -> bytes:
    """How the JSON of every record of a block begins (its identity members, in model order)."""
    compat, scope = space
    return b'{"block_key":"%s","compat_id":"%s","scope_id":"%s",' % (
        block_key.encode(),
        compat.encode(),
        scope.encode(),
    )


def record_tail(record: ReplicaRecord, ttl_ms: int) -> bytes:
    """The record's served JSON (with the granted, capped ``ttl_ms``) after its identity
    members, which the block supplies: stores keep only this tail."""
    if record.ttl_ms != ttl_ms:
        record = record.model_copy(update={"ttl_ms": ttl_ms})
    full = record.model_dump_json(by_alias=True, exclude_none=True).encode()
    prefix = identity_prefix((record.compat_id, record.scope_id), record.block_key)
    if not full.startswith(prefix):  # pragma: no cover - guards the member order of the model
        raise AssertionError("ReplicaRecord no longer serialises its identity members first")
    return full[len(prefix) :]


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
            self._rendered = b"[" + b",".join(prefix + r.tail for r in self.replicas) + b"]"
        return self._rendered

    def release_tails(self) -> None:
        """Let the rendered array be the only copy of the replicas' JSON (a store that keeps
        the array anyway saves a third of its memory). The tails are cut back out of the array
        before the replicas change: every record of the array begins with the block's
        identity prefix, which cannot occur inside a record (a JSON string cannot hold an
        unescaped quote), so ``,`` + prefix marks exactly the boundaries."""
        self.rendered()
        for replica in self.replicas:
            replica._tail = None

    def _restore_tails(self) -> None:
        if self._rendered is None or self.replicas[0]._tail is not None:
            return
        prefix = self._prefix()
        tails = self._rendered[1 + len(prefix) : -1].split(b"," + prefix)
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


def render_blocks(blocks: Sequence[BlockReplicas]) -> bytes:
    """The ``replicas`` member of a lookup answer: one JSON array per matched block."""
    return b",".join([b._rendered or b.rendered() for b in blocks])


# A lookup answer is _HEAD, the matched count, _MIDDLE, the replicas, _ESTIMATES, the estimates
# and "]}"; ReplicaTable.answer assembles the same octets in compiled code.
_HEAD = b'{"matched":'
_MIDDLE = b',"replicas":['
_ESTIMATES = b'],"estimates":['


def answer_json(blocks: Sequence[BlockReplicas], estimates: bytes = b"") -> bytes:
    """A whole lookup answer (KVSP 6.2) for the matched blocks and the estimates' JSON."""
    return b"%s%d%s%s%s%s]}" % (
        _HEAD,
        len(blocks),
        _MIDDLE,
        render_blocks(blocks),
        _ESTIMATES,
        estimates,
    )


def check_path(record: ReplicaRecord, compat: str, scope: str, block_key: str) -> None:
    """A record PUT to a block resource must describe that resource."""
    if (record.compat_id, record.scope_id, record.block_key) != (compat, scope, block_key):
        raise RecordError("the record's compat_id, scope_id and block_key must match the path")


def authorize_publish(principal: Principal, record: ReplicaRecord) -> None:
    """KVSP 6.1: the client is the record's holder or may publish for it, and may use its
    scope; for a moqt holder, the namespace's publisher is the holder (4.4)."""
    authorize(principal, PUBLISH_ROLES, scope=record.scope_id, holder=record.publisher)


def authorize_withdraw(principal: Principal, ref: ReplicaRef) -> None:
    authorize(principal, PUBLISH_ROLES, scope=ref.scope_id, holder=ref.publisher)


def authorize_lookup(principal: Principal, scope_id: str) -> None:
    """Refused whether or not the scope holds anything, so a refusal reveals nothing."""
    authorize(principal, LOOKUP_ROLES, scope=scope_id)


def authorize_status(principal: Principal, status: InstanceStatusRecord) -> None:
    authorize(principal, STATUS_ROLES, holder=status.instance)


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


def _probed(block_keys: Sequence[str]) -> Sequence[str] | bytes:
    """What the table probes: packed keys as they are, anything else key by key."""
    return block_keys.octets if isinstance(block_keys, PackedKeys) else block_keys


class ReplicaTable:
    """All replica records of an in-memory index.

    ``render_at_publish``: a record's JSON is rendered when it is published (a served index
    answers lookups with it, and bytes are smaller than records); an index embedded in a
    process that only reads cost summaries (the simulator) renders it only if ever asked."""

    def __init__(self, clock: Clock, limits: IndexLimits, render_at_publish: bool = True) -> None:
        self._clock = clock
        self._limits = limits
        self._render = render_at_publish
        # (compat, scope) -> block_key -> replicas: a lookup resolves its space once.
        self._spaces: dict[Space, KeyTable[BlockReplicas]] = {}
        self._deadlines: list[StoredReplica] = []
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
        summary_key = (record.holder, record.size, record.layer_count, record.residency)
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
        heapq.heapify(self._deadlines)

    def lookup(self, compat: str, scope: str, block_keys: Sequence[str]) -> list[BlockReplicas]:
        """Replicas of the leading keys that have any, stopping at the first key without one."""
        self.expire()
        blocks = self._spaces.get((compat, scope))
        return [] if blocks is None else blocks.prefix(_probed(block_keys))

    def answer(self, compat: str, scope: str, block_keys: Sequence[str]) -> tuple[int, bytes]:
        """The matched count and the whole lookup answer without estimates, as ``answer_json``
        would render it, assembled from the blocks' cached arrays in one copy."""
        self.expire()
        blocks = self._spaces.get((compat, scope))
        if blocks is None:
            return 0, answer_json(())
        return blocks.join_prefix(_probed(block_keys), _HEAD, _MIDDLE, b",", _ESTIMATES + b"]}")


@dataclass(slots=True)
class _InstanceEntry:
    epoch: int
    seen_at: int
    expires_at: int
    status: InstanceStatusRecord


class StatusTable:
    """Latest Instance Status Record per instance; a lower epoch than the highest seen is stale.

    The highest epoch of an instance is remembered for ``STATUS_RETENTION_MS`` after its last
    status (a restarted instance has a higher epoch anyway), and at most
    ``IndexLimits.max_instances`` instances are tracked, so statuses cannot pin memory.
    """

    def __init__(self, clock: Clock, limits: IndexLimits) -> None:
        self.clock = clock
        self._limits = limits
        self._entries: OrderedDict[str, _InstanceEntry] = OrderedDict()  # oldest put first

    def _forget_old(self, now: int) -> None:
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.seen_at + STATUS_RETENTION_MS > now:
                return
            self._entries.popitem(last=False)

    def put(self, status: InstanceStatusRecord) -> None:
        now = self.clock.now_ms()
        self._forget_old(now)
        instance = canonical_url(status.instance)
        entry = self._entries.get(instance)
        if entry is not None and status.epoch < entry.epoch:
            raise StaleEpoch(
                f"epoch {status.epoch} of {status.instance} is below {entry.epoch}, already seen"
            )
        if entry is None and len(self._entries) >= self._limits.max_instances:
            raise CapacityExhausted(
                f"the index tracks {len(self._entries)} instances, the configured maximum"
            )
        self._entries[instance] = _InstanceEntry(status.epoch, now, now + status.ttl_ms, status)
        self._entries.move_to_end(instance)

    def get(self, instance: str) -> InstanceStatusRecord | None:
        entry = self._entries.get(canonical_url(instance))
        if entry is None or entry.expires_at <= self.clock.now_ms():
            return None
        return entry.status


def estimate_targets(
    targets: Sequence[str],
    statuses: Mapping[str, InstanceStatusRecord],
    matched: Sequence[BlockReplicas],
    block_tokens: int | None,
) -> list[TargetEstimate]:
    """``fetch_us`` and ``recompute_us`` for each target the IS knows (KVSP 6.2, 6.4).

    ``fetch_us`` makes the usable matched prefix resident at the target; ``fetch_blocks`` says
    how many blocks that prefix holds (fewer than ``matched`` when a block has no source the
    target has a link to). ``recompute_us`` prefills the same tokens at the target.
    """
    if block_tokens is None:
        return []
    planner = FetchPlanner(
        [[replica.get_summary() for replica in block.replicas] for block in matched]
    )
    out = []
    for target in targets:
        status = statuses.get(canonical_url(target))
        if status is None:
            continue
        plan = planner.plan(status)
        out.append(
            TargetEstimate(
                target=target,
                fetch_us=plan.fetch_us,
                recompute_us=recompute_us(len(matched) * block_tokens, status.prefill_tokens_per_s),
                fetch_blocks=plan.usable_blocks,
            )
        )
    return out
