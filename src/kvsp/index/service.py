"""The Index Service's operations: authorize, validate against the path, then the store.

Every check that can refuse a request runs before the store is touched, so a refused request
changes nothing. Lookups are answered as JSON octets assembled from the stored record bodies:
the hot path never builds a pydantic model per record.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvsp.auth import Principal
from kvsp.core.records import (
    InstanceStatusRecord,
    LookupRequest,
    ReplicaBatch,
    ReplicaRecord,
    ReplicaRef,
)
from kvsp.index.state import (
    PublishOutcome,
    authorize_lookup,
    authorize_publish,
    authorize_status,
    authorize_withdraw,
    estimate_targets,
)
from kvsp.index.stores import ReplicaStore

__all__ = ["IndexMetrics", "IndexService"]

_MATCHED_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)


@dataclass
class IndexMetrics:
    """Prometheus metrics of one Index Service (its own registry, so several can coexist)."""

    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.records = Gauge(
            "kvsp_index_records", "Replica records held, by scope", ["scope"], registry=r
        )
        self.publishes = Counter(
            "kvsp_index_publishes", "Records published", ["result"], registry=r
        )
        self.withdrawals = Counter("kvsp_index_withdrawals", "Records withdrawn", registry=r)
        self.lookups = Counter("kvsp_index_lookups", "Lookups answered", registry=r)
        self.lookup_keys = Counter("kvsp_index_lookup_keys", "Block keys asked for", registry=r)
        self.matched = Histogram(
            "kvsp_index_lookup_matched_blocks",
            "Matched blocks per lookup",
            buckets=_MATCHED_BUCKETS,
            registry=r,
        )
        self.hit_ratio = Gauge(
            "kvsp_index_hit_ratio",
            "Matched block keys / block keys asked for, since start",
            registry=r,
        )
        self.expired = Gauge(
            "kvsp_index_expired_records", "Records removed because their TTL passed", registry=r
        )
        self.rejected = Counter(
            "kvsp_index_rejected_requests", "Requests answered with a problem", ["type"], registry=r
        )
        self._asked = 0
        self._hits = 0

    def observe_lookup(self, asked: int, matched: int) -> None:
        self.lookups.inc()
        self.lookup_keys.inc(asked)
        self.matched.observe(matched)
        self._asked += asked
        self._hits += matched
        self.hit_ratio.set(self._hits / self._asked if self._asked else 0.0)


class IndexService:
    def __init__(self, store: ReplicaStore, metrics: IndexMetrics | None = None) -> None:
        self.store = store
        self.metrics = metrics or IndexMetrics()

    async def publish(
        self, principal: Principal, records: Sequence[ReplicaRecord]
    ) -> list[PublishOutcome]:
        for record in records:
            authorize_publish(principal, record)
        outcomes = await self.store.publish(records)
        for outcome in outcomes:
            self.metrics.publishes.labels("created" if outcome.created else "refreshed").inc()
        return outcomes

    async def withdraw(self, principal: Principal, refs: Sequence[ReplicaRef]) -> list[bool]:
        for ref in refs:
            authorize_withdraw(principal, ref)
        removed = await self.store.withdraw(refs)
        self.metrics.withdrawals.inc(sum(removed))
        return removed

    async def batch(self, principal: Principal, batch: ReplicaBatch) -> bytes:
        """``POST replicas``: every entry is authorized before anything changes."""
        for record in batch.put:
            authorize_publish(principal, record)
        for ref in batch.delete:
            authorize_withdraw(principal, ref)
        outcomes = await self.publish(principal, batch.put) if batch.put else []
        removed = await self.withdraw(principal, batch.delete) if batch.delete else []
        return json.dumps(
            {
                "put": [{"created": o.created, "ttl_ms": o.ttl_ms} for o in outcomes],
                "delete": [{"withdrawn": w} for w in removed],
            }
        ).encode()

    async def lookup(self, principal: Principal, request: LookupRequest) -> bytes:
        authorize_lookup(principal, request)
        targets = request.targets or ()
        result = await self.store.lookup(
            request.compat_id, request.scope_id, request.block_keys, targets
        )
        matched = result.matched
        self.metrics.observe_lookup(len(request.block_keys), len(matched))
        now = result.now_ms
        replicas = b",".join(
            b"[" + b",".join(r.to_json(now) for r in replica_list) + b"]"
            for replica_list in matched
        )
        estimates = estimate_targets(targets, result.statuses, matched, request.block_tokens)
        estimates_json = ",".join(e.model_dump_json(exclude_none=True) for e in estimates)
        return b'{"matched":%d,"replicas":[%s],"estimates":[%s]}' % (
            len(matched),
            replicas,
            estimates_json.encode(),
        )

    async def put_status(self, principal: Principal, status: InstanceStatusRecord) -> None:
        authorize_status(principal, status)
        await self.store.put_status(status)

    async def refresh_gauges(self) -> None:
        """Bring the scrape-time gauges (records by scope, expiries) up to date."""
        counts = await self.store.counts_by_scope()
        self.metrics.records.clear()
        for scope, count in counts.items():
            self.metrics.records.labels(scope).set(count)
        self.metrics.expired.set(await self.store.expired_total())
