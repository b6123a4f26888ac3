"""The Index Service's operations: authorize, validate against the path, then the store.

Every check that can refuse a request runs before the store is touched, so a refused request
changes nothing. Lookups are answered as JSON octets assembled from the stored record bodies:
the hot path never builds a pydantic model per record.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import itemgetter

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import (
    CounterMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kvsp.auth import Principal, authorize
from kvsp.core.compat import CompatibilityDescriptor
from kvsp.core.problems import DescriptorError, KvspError, RecordError
from kvsp.core.records import (
    InstanceStatusRecord,
    ReplicaBatch,
    ReplicaRecord,
    ReplicaRef,
)
from kvsp.index.puts import RecordShapes
from kvsp.index.queries import LookupQuery
from kvsp.index.replicas import PublishOutcome, holder_runs
from kvsp.index.rules import (
    DESCRIPTOR_ROLES,
    authorize_holders,
    authorize_lookup,
    authorize_replicas,
    authorize_status,
)
from kvsp.index.statuses import estimate_targets
from kvsp.index.stores import ReplicaStore
from kvsp.index.wire import batch_json, holders_json

__all__ = ["IndexMetrics", "IndexService"]

_MATCHED_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)


class _LookupStats:
    """Lookup counters kept as plain integers (a lookup is too cheap to pay for locked metric
    objects) and exported when Prometheus scrapes."""

    def __init__(self) -> None:
        self.lookups = 0
        self.asked = 0
        self.hits = 0
        self.buckets = [0] * (len(_MATCHED_BUCKETS) + 1)

    def observe(self, asked: int, matched: int) -> None:
        self.lookups += 1
        self.asked += asked
        self.hits += matched
        self.buckets[bisect.bisect_left(_MATCHED_BUCKETS, matched)] += 1

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("kvsp_index_lookups", "Lookups answered", value=self.lookups)
        yield CounterMetricFamily(
            "kvsp_index_lookup_keys", "Block keys asked for", value=self.asked
        )
        # a hit rate is rate(hits) / rate(keys): two counters, never a since-start ratio
        yield CounterMetricFamily(
            "kvsp_index_lookup_hits", "Block keys asked for and matched", value=self.hits
        )
        cumulative = list(itertools.accumulate(self.buckets))
        yield HistogramMetricFamily(
            "kvsp_index_lookup_matched_blocks",
            "Matched blocks per lookup",
            buckets=[
                *((str(float(b)), c) for b, c in zip(_MATCHED_BUCKETS, cumulative, strict=False)),
                ("+Inf", cumulative[-1]),
            ],
            sum_value=self.hits,
        )


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
        # each result's child made once: a publish of a batch counts it without a label lookup
        self.created = self.publishes.labels("created")
        self.refreshed = self.publishes.labels("refreshed")
        self.withdrawals = Counter("kvsp_index_withdrawals", "Records withdrawn", registry=r)
        self.expired = Gauge(
            "kvsp_index_expired_records", "Records removed because their TTL passed", registry=r
        )
        self.rejected = Counter(
            "kvsp_index_rejected_requests",
            "Requests answered with a problem",
            ["type"],
            registry=r,
        )
        self.lookups = _LookupStats()
        r.register(self.lookups)


#: layers a published record may name (a record with 65,535 layer digests is 4.4 MB)
DEFAULT_MAX_LAYERS = 1024


class IndexService:
    def __init__(
        self,
        store: ReplicaStore,
        metrics: IndexMetrics | None = None,
        max_layers: int = DEFAULT_MAX_LAYERS,
        descriptors: Sequence[CompatibilityDescriptor] = (),
    ) -> None:
        self.store = store
        self.metrics = metrics or IndexMetrics()
        self.max_layers = max_layers
        #: the block size of every Compatibility ID whose descriptor is known here: the
        #: configured ones, and those registered and read back (an ID names one descriptor,
        #: so what is known never changes)
        self._block_tokens = {d.compat_id().hex(): d.block_tokens for d in descriptors}
        #: the shapes of split publish batches validated so far (``batch_body``)
        self._shapes = RecordShapes()

    async def register(self, principal: Principal, compat: str, body: bytes) -> bool:
        """``PUT descriptors/{compat}``: a holder or instance says what its Compatibility ID
        stands for (KVSP 4.1), so lookups as 6.2 writes them get estimates. The ID is
        recomputed from the descriptor, never taken on trust; True if it was new here."""
        authorize(principal, DESCRIPTOR_ROLES)
        descriptor = CompatibilityDescriptor.parse(body)
        computed = descriptor.compat_id().hex()
        if computed != compat:
            raise DescriptorError(f"the descriptor's Compatibility ID is {computed}, not {compat}")
        created = await self.store.put_descriptor(compat, descriptor.canonical())
        self._block_tokens[compat] = descriptor.block_tokens
        return created

    async def _block_tokens_of(self, compat: str) -> int | None:
        known = self._block_tokens.get(compat)
        if known is None:
            stored = await self.store.descriptor(compat)
            if stored is not None:
                known = CompatibilityDescriptor.parse(stored).block_tokens
                self._block_tokens[compat] = known
        return known

    async def publish(
        self, principal: Principal, records: Sequence[ReplicaRecord]
    ) -> list[PublishOutcome]:
        authorize_replicas(principal, records)
        return await self._publish(records)

    async def withdraw(self, principal: Principal, refs: Sequence[ReplicaRef]) -> list[bool]:
        authorize_replicas(principal, refs)
        return await self._withdraw(refs)

    def _check_layers(self, records: Iterable[ReplicaRecord]) -> None:
        """Records are bounded in octets: refused before anything changes."""
        for record in records:
            if record.layer_count > self.max_layers:
                raise RecordError(
                    f"record of {record.block_key} names {record.layer_count} layers; this "
                    f"Index Service takes at most {self.max_layers}"
                )

    async def _publish(self, records: Sequence[ReplicaRecord]) -> list[PublishOutcome]:
        self._check_layers(records)
        return self._counted(await self.store.publish(records))

    def _counted(self, outcomes: list[PublishOutcome]) -> list[PublishOutcome]:
        # counted once per batch: a labelled counter per record cost 3 % of an ingest
        created = sum(map(itemgetter(0), outcomes))  # each outcome's ``created``
        for counter, count in (
            (self.metrics.created, created),
            (self.metrics.refreshed, len(outcomes) - created),
        ):
            if count:
                counter.inc(count)
        return outcomes

    async def _withdraw(self, refs: Sequence[ReplicaRef]) -> list[bool]:
        removed = await self.store.withdraw(refs)
        self.metrics.withdrawals.inc(sum(removed))
        return removed

    async def batch(self, principal: Principal, batch: ReplicaBatch) -> bytes:
        """``POST replicas``: every entry is authorized before anything changes."""
        authorize_replicas(principal, batch.put)
        authorize_replicas(principal, batch.delete)
        outcomes = await self._publish(batch.put) if batch.put else []
        removed = await self._withdraw(batch.delete) if batch.delete else []
        return batch_json(outcomes, removed)

    async def batch_body(self, principal: Principal, body: bytes) -> bytes:
        """``batch`` of a request's body: a holder's plain batch of records is split, each
        distinct shape of record validated once and each record's identity taken as checked
        by the splitter (decision 0030); any other body is parsed whole."""
        puts = self._shapes.split(body)
        if puts is None:
            return await self.batch(principal, ReplicaBatch.parse(body))
        authorize_holders(principal, puts.holders())
        self._check_layers(shape.record for shape in dict.fromkeys(r.shape for r in puts.runs))
        outcomes = self._counted(await self.store.publish_shared(puts))
        return batch_json(outcomes, [])

    async def lookup(self, principal: Principal, query: LookupQuery) -> bytes:
        """The answer's JSON: without estimates to make, straight from the store's ``answer``
        or, in the compact form, its ``holders``."""
        authorize_lookup(principal, query.scope_id)
        block_tokens = query.block_tokens
        if query.targets and block_tokens is None:
            block_tokens = await self._block_tokens_of(query.compat_id)
        # targets without a known block size get no estimates
        targets = query.targets or () if block_tokens is not None else ()
        if not targets and query.answer is None:
            matched, answer = await self.store.answer(
                query.compat_id, query.scope_id, query.block_keys
            )
            self.metrics.lookups.observe(len(query.block_keys), matched)
            return answer
        if not targets and query.answer == "holders":
            matched, runs = await self.store.holders(
                query.compat_id, query.scope_id, query.block_keys
            )
            self.metrics.lookups.observe(len(query.block_keys), matched)
            return holders_json(runs)
        result = await self.store.lookup(query.compat_id, query.scope_id, query.block_keys, targets)
        blocks = result.matched
        self.metrics.lookups.observe(len(query.block_keys), len(blocks))
        estimates = b""
        if targets and block_tokens is not None:
            made = estimate_targets(targets, result.statuses, blocks, block_tokens)
            estimates = ",".join(e.model_dump_json(exclude_none=True) for e in made).encode()
        if query.answer == "holders":
            return holders_json(holder_runs(blocks), estimates)
        return result.answered(estimates)

    async def put_status(self, principal: Principal, status: InstanceStatusRecord) -> None:
        authorize_status(principal, status)
        await self.store.put_status(status)

    async def readiness(self) -> list[str]:
        """Why this Index Service should get no traffic now (``readyz``): its store does not
        answer."""
        try:
            await self.store.ping()
        except KvspError as exc:
            return [f"the {self.store.name} store does not answer: {exc.detail}"]
        return []

    async def refresh_gauges(self) -> None:
        """Bring the scrape-time gauges (records by scope, expiries) up to date."""
        counts = await self.store.counts_by_scope()
        self.metrics.records.clear()
        for scope, count in counts.items():
            self.metrics.records.labels(scope).set(count)
        self.metrics.expired.set(await self.store.expired_total())
