"""Index Service state, pure and Clock-injected: replica records with TTLs, prefix lookup,
instance statuses with epoch rules, and who may do what (KVSP 6.1, 6.2, 6.3, 6.4).

Records are kept as the JSON the IS serves (without ``ttl_ms``, which is the *remaining* TTL
and is appended when a lookup answers) plus a ``ReplicaSummary`` for estimates, so a lookup
never re-serialises a record and a record costs a few hundred octets. Expiry pops a heap of
deadlines, so it costs O(expired), never a scan; refreshes leave stale heap entries behind,
which are skipped when popped and compacted away when they outnumber the live ones.
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvsp.auth import Principal, Role, authorize
from kvsp.core.clock import Clock
from kvsp.core.cost import ReplicaSummary, plan_fetch, recompute_us
from kvsp.core.problems import CapacityExhausted, RecordError, StaleEpoch
from kvsp.core.records import (
    InstanceStatusRecord,
    LookupRequest,
    ReplicaRecord,
    ReplicaRef,
    TargetEstimate,
)
from kvsp.core.urls import canonical_url

__all__ = [
    "LOOKUP_ROLES",
    "PUBLISH_ROLES",
    "STATUS_ROLES",
    "BlockId",
    "IndexLimits",
    "PublishOutcome",
    "ReplicaTable",
    "StatusTable",
    "StoredReplica",
    "authorize_lookup",
    "authorize_publish",
    "authorize_status",
    "authorize_withdraw",
    "check_path",
    "estimate_targets",
    "record_body",
]

PUBLISH_ROLES = (Role.HOLDER, Role.INSTANCE)
LOOKUP_ROLES = (Role.CONTROLLER, Role.INSTANCE, Role.HOLDER, Role.CLIENT)
STATUS_ROLES = (Role.INSTANCE, Role.CONTROLLER)

#: (compat_id, scope_id, block_key), lowercase hex.
BlockId = tuple[str, str, str]


@dataclass(frozen=True, slots=True)
class IndexLimits:
    """Bounds an operator sets: the TTL cap (6.1) and the record count past which publishing
    answers 507 instead of growing without bound."""

    max_ttl_ms: int = 600_000
    max_records: int = 5_000_000


@dataclass(frozen=True, slots=True)
class PublishOutcome:
    created: bool
    ttl_ms: int


def record_body(record: ReplicaRecord) -> bytes:
    """The record's JSON without ``ttl_ms`` and without the closing brace; ``ttl_ms`` (the
    remaining TTL) is appended when the record is served."""
    return (
        record.model_copy(update={"ttl_ms": None})
        .model_dump_json(by_alias=True, exclude_none=True)
        .encode()[:-1]
    )


@dataclass(slots=True)
class StoredReplica:
    """One record as stored: its deadline on the store's clock, its served JSON, its summary."""

    expires_at: int
    body: bytes
    summary: ReplicaSummary | None = None

    def to_json(self, now_ms: int) -> bytes:
        remaining = max(self.expires_at - now_ms, 1)
        return self.body + b',"ttl_ms":%d}' % remaining

    def get_summary(self) -> ReplicaSummary:
        if self.summary is None:
            self.summary = ReplicaSummary.of(ReplicaRecord.parse(self.to_json(0)))
        return self.summary


def check_path(record: ReplicaRecord, compat: str, scope: str, block_key: str) -> None:
    """A record PUT to a block resource must describe that resource."""
    if (record.compat_id, record.scope_id, record.block_key) != (compat, scope, block_key):
        raise RecordError("the record's compat_id, scope_id and block_key must match the path")


def authorize_publish(principal: Principal, record: ReplicaRecord) -> None:
    authorize(principal, PUBLISH_ROLES, scope=record.scope_id, holder=record.holder)


def authorize_withdraw(principal: Principal, ref: ReplicaRef) -> None:
    authorize(principal, PUBLISH_ROLES, scope=ref.scope_id, holder=ref.holder)


def authorize_lookup(principal: Principal, request: LookupRequest) -> None:
    """Refused whether or not the scope holds anything, so a refusal reveals nothing."""
    authorize(principal, LOOKUP_ROLES, scope=request.scope_id)


def authorize_status(principal: Principal, status: InstanceStatusRecord) -> None:
    authorize(principal, STATUS_ROLES, holder=status.instance)


class ReplicaTable:
    """All replica records of an in-memory index."""

    def __init__(self, clock: Clock, limits: IndexLimits) -> None:
        self._clock = clock
        self._limits = limits
        self._blocks: dict[BlockId, dict[str, StoredReplica]] = {}
        self._deadlines: list[tuple[int, BlockId, str]] = []
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

    def publish(self, record: ReplicaRecord) -> PublishOutcome:
        """Store or refresh (same record, new deadline) one record; 507 past the limit."""
        return self.publish_many([record])[0]

    def publish_many(self, records: Sequence[ReplicaRecord]) -> list[PublishOutcome]:
        """Publish a batch atomically: either every record is stored or none is."""
        now = self.expire()
        new = {
            (r.compat_id, r.scope_id, r.block_key, canonical_url(r.holder))
            for r in records
            if canonical_url(r.holder)
            not in self._blocks.get((r.compat_id, r.scope_id, r.block_key), {})
        }
        if self._count + len(new) > self._limits.max_records:
            raise CapacityExhausted(
                f"the index holds {self._count} records; {len(new)} more would pass the limit "
                f"of {self._limits.max_records}"
            )
        return [self._store(record, now) for record in records]

    def _store(self, record: ReplicaRecord, now: int) -> PublishOutcome:
        ttl = min(record.ttl_ms, self._limits.max_ttl_ms)
        block: BlockId = (record.compat_id, record.scope_id, record.block_key)
        holder = sys.intern(canonical_url(record.holder))
        holders = self._blocks.setdefault(block, {})
        created = holder not in holders
        deadline = now + ttl
        holders[holder] = StoredReplica(deadline, record_body(record), ReplicaSummary.of(record))
        heapq.heappush(self._deadlines, (deadline, block, holder))
        if created:
            self._count += 1
            self._by_scope[record.scope_id] = self._by_scope.get(record.scope_id, 0) + 1
        if len(self._deadlines) > 2 * self._count + 1024:
            self._compact()
        return PublishOutcome(created, ttl)

    def withdraw(self, ref: ReplicaRef) -> bool:
        self.expire()
        return self._remove((ref.compat_id, ref.scope_id, ref.block_key), canonical_url(ref.holder))

    def _remove(self, block: BlockId, holder: str) -> bool:
        holders = self._blocks.get(block)
        if holders is None or holders.pop(holder, None) is None:
            return False
        if not holders:
            del self._blocks[block]
        self._count -= 1
        scope = block[1]
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
        while deadlines and deadlines[0][0] <= now:
            deadline, block, holder = heapq.heappop(deadlines)
            stored = self._blocks.get(block, {}).get(holder)
            if stored is not None and stored.expires_at == deadline and self._remove(block, holder):
                self.expired_total += 1
        return now

    def _compact(self) -> None:
        self._deadlines = [
            (stored.expires_at, block, holder)
            for block, holders in self._blocks.items()
            for holder, stored in holders.items()
        ]
        heapq.heapify(self._deadlines)

    def lookup(
        self, compat: str, scope: str, block_keys: Iterable[str]
    ) -> tuple[int, list[list[StoredReplica]]]:
        """Replicas of the leading keys that have any, stopping at the first key without one."""
        now = self.expire()
        found: list[list[StoredReplica]] = []
        for key in block_keys:
            holders = self._blocks.get((compat, scope, key))
            if not holders:
                break
            found.append(list(holders.values()))
        return now, found


class StatusTable:
    """Latest Instance Status Record per instance; a lower epoch than the highest seen is stale."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._latest: dict[str, tuple[int, InstanceStatusRecord]] = {}
        self._highest_epoch: dict[str, int] = {}

    def put(self, status: InstanceStatusRecord) -> None:
        instance = canonical_url(status.instance)
        highest = self._highest_epoch.get(instance, -1)
        if status.epoch < highest:
            raise StaleEpoch(
                f"epoch {status.epoch} of {status.instance} is below {highest}, already seen"
            )
        self._highest_epoch[instance] = status.epoch
        self._latest[instance] = (self.clock.now_ms() + status.ttl_ms, status)

    def get(self, instance: str) -> InstanceStatusRecord | None:
        entry = self._latest.get(canonical_url(instance))
        if entry is None or entry[0] <= self.clock.now_ms():
            return None
        return entry[1]


def estimate_targets(
    targets: Sequence[str],
    statuses: Mapping[str, InstanceStatusRecord],
    matched: Sequence[Sequence[StoredReplica]],
    block_tokens: int | None,
) -> list[TargetEstimate]:
    """``fetch_us`` and ``recompute_us`` for each target the IS knows (KVSP 6.2, 6.4).

    ``fetch_us`` makes the usable matched prefix resident at the target; ``fetch_blocks`` says
    how many blocks that prefix holds (fewer than ``matched`` when a block has no source the
    target has a link to). ``recompute_us`` prefills the same tokens at the target.
    """
    if block_tokens is None:
        return []
    summaries = [[replica.get_summary() for replica in replicas] for replicas in matched]
    out = []
    for target in targets:
        status = statuses.get(canonical_url(target))
        if status is None:
            continue
        plan = plan_fetch(status, summaries)
        out.append(
            TargetEstimate(
                target=target,
                fetch_us=plan.fetch_us,
                recompute_us=recompute_us(len(matched) * block_tokens, status.prefill_tokens_per_s),
                fetch_blocks=plan.usable_blocks,
            )
        )
    return out
