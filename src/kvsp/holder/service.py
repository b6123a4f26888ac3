"""The holder's operations: authorize, validate, then the store; and the Index Service kept
informed of what the store holds.

The store and the lease table are plain objects; every operation on them runs in one worker
thread, in order, so disk writes and SHA-256 over megabytes never stall the event loop and no
lock is needed. The effects each operation leaves (publish, withdraw) are coalesced per block,
latest first wins, and sent to the Index Service in batches by one task that retries while the
IS is away; records are republished before they expire.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar, cast, get_args
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvsp.auth import Principal, Role, authorize
from kvsp.core.clock import Clock, SystemClock
from kvsp.core.container import Container, peek_header
from kvsp.core.problems import (
    AlreadyStored,
    CapacityExhausted,
    ConfigurationError,
    ContainerLengthError,
    Forbidden,
    InvalidInput,
    KvspError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
)
from kvsp.core.records import LeaseGrant, LeaseRequest, ReplicaRecord, ReplicaRef
from kvsp.core.registries import Tier
from kvsp.core.urls import canonical_url
from kvsp.holder.blocks import MAX_BLOCK_OCTETS, BlockId, BlockMeta, block_ref
from kvsp.holder.leases import LeaseLimits, LeaseTable
from kvsp.holder.store import (
    BlockRead,
    BlockStore,
    Effect,
    LeaseView,
    Protected,
    Publish,
    TierData,
    TierSpec,
    Withdraw,
)
from kvsp.holder.tiers import DiskTier, MemoryTier
from kvsp.index.client import IndexClient
from kvsp.quotas import Quotas
from kvsp.tasks import cancel_all

__all__ = ["BLOCK_ROLES", "HolderConfig", "HolderService", "IndexRoutes", "parse_index_routes"]

log = logging.getLogger("kvsp.holder")
T = TypeVar("T")

#: Roles that may read, store and lease blocks (always within their scopes).
BLOCK_ROLES = (Role.CLIENT, Role.INSTANCE, Role.HOLDER, Role.CONTROLLER)
#: Effects sent to the Index Service in one batch, at most, and the octets of their records
#: (well below the IS's default 5 MiB body limit: a record with many layers is large).
BATCH = 1024
BATCH_OCTETS = 2 << 20
#: index updates waiting beyond which a miss no longer withdraws its stale record
STALE_WITHDRAWALS = 65_536


@dataclass(frozen=True)
class HolderConfig:
    url: str
    host_bytes: int
    disk_dir: Path | None = None
    disk_bytes: int = 0
    leases: LeaseLimits = field(default_factory=LeaseLimits)
    record_ttl_ms: int = 600_000
    #: read rates reported in Replica Records (a holder's own memory is not worth reporting;
    #: an instance reports its host tier, since its device tier is faster)
    disk_read_mbit_per_s: float = 16_000.0
    host_read_mbit_per_s: float | None = None
    max_block_octets: int = MAX_BLOCK_OCTETS
    #: layers a stored container may have (the IS refuses records with more)
    max_layers: int = 1024
    #: octets each block counts beside its data (its metadata's memory, measured at about
    #: 2.1 KB a block), so many tiny blocks fill a tier by their number
    block_overhead_octets: int = 2048
    #: octets of block PUT bodies being received at once; beyond it a PUT is 503 + Retry-After
    max_inflight_octets: int = 1 << 30
    index_url: str | None = None
    index_token: str | None = None
    #: how records reach the IS: KVSP 6.1's PUT and DELETE per record ("text"), the batch
    #: extension ``POST replicas`` ("batch"), or the batch until the IS answers that it has no
    #: such route, then the text's ("auto")
    index_routes: IndexRoutes = "auto"
    #: per scope: stored octets, leased octets and leases (``kvsp.quotas``)
    quotas: Quotas = field(default_factory=Quotas)

    def tiers(self) -> tuple[list[TierSpec], dict[Tier, TierData]]:
        specs = [TierSpec("host", self.host_bytes, self.host_read_mbit_per_s)]
        data: dict[Tier, TierData] = {"host": MemoryTier()}
        if self.disk_dir is not None:
            specs.append(TierSpec("disk", self.disk_bytes, self.disk_read_mbit_per_s))
            data["disk"] = DiskTier(self.disk_dir)
        elif self.disk_bytes:
            raise ConfigurationError("--disk-bytes needs --disk-dir")
        return specs, data


IndexRoutes = Literal["auto", "batch", "text"]


def parse_index_routes(text: str) -> IndexRoutes:
    """``--index-routes``: auto, batch or text; anything else is a ``ConfigurationError``."""
    for routes in get_args(IndexRoutes):
        if text == routes:
            return cast(IndexRoutes, routes)
    raise ConfigurationError(f"--index-routes is auto, batch or text, not {text!r}")


#: records sent at once over the text's routes, one request each
TEXT_CONCURRENCY = 16


def _then_forget(effect: Effect) -> bool:
    return isinstance(effect, Withdraw) and effect.then_forget


def _effect_octets(effect: Effect) -> int:
    """About how many octets an effect takes in a batch body."""
    if isinstance(effect, Publish):
        return 700 + 67 * len(effect.record.layer_digests or ())
    return 300


class HolderService:
    def __init__(
        self,
        config: HolderConfig,
        clock: Clock | None = None,
        index: IndexClient | None = None,
        device: tuple[int, TierData] | None = None,
        in_use: LeaseView | None = None,
        observe: Callable[[Sequence[Effect]], None] | None = None,
    ) -> None:
        """``index`` replaces the client built from ``config.index_url`` (tests pass one).
        An inference instance adds its ``device`` tier (capacity, octets) in front of the
        others, the blocks it protects (``in_use``: blocks its running requests use, pins),
        which pressure never moves or drops, like leased ones, and an observer of every
        publish and withdraw (on the event loop, in order)."""
        parts = urlsplit(config.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigurationError(f"holder URL {config.url!r} is not an http(s) URL")
        self.config = config
        self.url = canonical_url(config.url)
        self.clock = clock or SystemClock()
        self.observe = observe
        specs, data = config.tiers()
        if device is not None:
            specs.insert(0, TierSpec("device", device[0]))
            data["device"] = device[1]
        self._disk = data.get("disk")
        self.leases = LeaseTable(self.clock, config.leases, config.quotas)
        protected: LeaseView = self.leases if in_use is None else Protected(self.leases, in_use)
        self.store = BlockStore(
            specs,
            data,
            protected,
            self.clock,
            self.url,
            config.record_ttl_ms,
            config.block_overhead_octets,
            config.quotas,
        )
        self.capacities = {s.name: s.capacity for s in specs}
        if index is None and config.index_url is not None:
            index = IndexClient(config.index_url, config.index_token)
        self.index = index
        #: the routes records go by ("auto" until the IS has answered a batch)
        self.routes: IndexRoutes = config.index_routes
        self.registry = CollectorRegistry()
        self.rejected = Counter(
            "kvsp_holder_rejected_requests",
            "Requests answered with a problem",
            ["type"],
            registry=self.registry,
        )
        self.index_refused = Counter(
            "kvsp_holder_index_refused",
            "Publishes and withdrawals the Index Service refused (dropped), by problem type",
            ["type"],
            registry=self.registry,
        )
        self._snapshot = _Snapshot()
        self.registry.register(self._snapshot)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvsp-holder-store")
        #: held by whoever works on the store: its thread, or the loop for a quick read
        self._lock = threading.Lock()
        self._pending: OrderedDict[BlockId, Effect] = OrderedDict()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        #: between the end of ``start`` (the disk tier's blocks are back) and ``close``
        self.serving = False
        #: SHA-256 of each held block's whole container, for Repr-Digest of full GETs
        self._repr: dict[BlockId, bytes] = {}
        #: the event loop it runs on, once started
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- running -------------------------------------------------------------------------------

    def _run(self, fn: Callable[[], T]) -> tuple[T, list[Effect]]:
        """``fn`` and the effects it left; the caller holds ``_lock``."""
        result = fn()
        effects = self.store.take_effects()
        for effect in effects:
            if isinstance(effect, Withdraw):
                ref = effect.ref
                self._repr.pop((ref.compat_id, ref.scope_id, ref.block_key), None)
        return result, effects

    def _settle(self, result: T, effects: list[Effect]) -> T:
        """On the event loop: queue the effects an operation left, tell the observer."""
        self._queue(effects)
        if self.observe is not None and effects:
            self.observe(effects)
        return result

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the store's thread, then queue the effects it left."""

        def call() -> tuple[T, list[Effect]]:
            with self._lock:
                return self._run(fn)

        result, effects = await asyncio.get_running_loop().run_in_executor(self._worker, call)
        return self._settle(result, effects)

    def _call_here(self, fn: Callable[[], T | None]) -> T | None:
        """Run ``fn`` on the event loop when the store is free this instant, so a quick
        operation need not wait for the store's thread to wake; None when the store is busy or
        ``fn`` found the operation not quick (and did nothing)."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            result, effects = self._run(fn)
        finally:
            self._lock.release()
        return self._settle(result, effects)

    async def start(self) -> None:
        """Take back what the disk tier kept over a restart, then start publishing."""
        self._loop = asyncio.get_running_loop()
        if isinstance(self._disk, DiskTier):
            restored, failed = await self.call(self._restore)
            log.info("disk tier: %d blocks restored, %d removed", restored, len(failed))
            self._queue([Withdraw(self._ref(block)) for block in failed])
        self._tasks = [
            asyncio.create_task(self._publisher(), name="kvsp-holder-publisher"),
            asyncio.create_task(self._refresher(), name="kvsp-holder-refresher"),
        ]
        self.serving = True

    async def readiness(self) -> list[str]:
        """Why this holder should get no traffic now (``readyz``): not yet started (its disk
        scan runs first) or stopping."""
        return [] if self.serving else ["the holder is starting or stopping"]

    def _restore(self) -> tuple[int, list[BlockId]]:
        """(blocks restored, blocks removed: files that failed verification, or that the disk
        tier no longer has room for); the removed ones are withdrawn."""
        assert isinstance(self._disk, DiskTier)
        restored = 0
        failed = []
        for found in self._disk.scan():
            if found.block is None or found.meta is None or found.span is None:
                self.store.stats.digest_failures += 1
                log.warning("removed %s: %s", found.path, found.problem)
                if found.block is not None:
                    failed.append(found.block)
            elif self.store.restore(found.block, found.meta, "disk", found.span):
                restored += 1
            else:
                failed.append(found.block)
        return restored, failed

    def _ref(self, block: BlockId) -> ReplicaRef:
        compat, scope, key = block
        return ReplicaRef.model_construct(
            compat_id=compat, scope_id=scope, block_key=key, holder=self.url
        )

    async def close(self) -> None:
        """Stop: withdraw what this holder will no longer serve (blocks with no copy on
        disk), then deliver what is pending, for at most 2 s."""
        self.serving = False
        await cancel_all(self._tasks)
        if self.index is not None:
            lost = await self.call(self.store.volatile)
            self._queue([Withdraw(self._ref(block)) for block in lost])
            try:
                await asyncio.wait_for(self._flush(), timeout=2.0)
            except (TimeoutError, KvspError):
                log.warning("%d index updates not delivered at shutdown", len(self._pending))
            await self.index.aclose()
        self._worker.shutdown(wait=True)

    # -- the Index Service ---------------------------------------------------------------------

    def _queue(self, effects: Sequence[Effect]) -> None:
        for effect in effects:
            if isinstance(effect, Publish):
                r = effect.record
                block = (r.compat_id, r.scope_id, r.block_key)
            else:
                ref = effect.ref
                block = (ref.compat_id, ref.scope_id, ref.block_key)
            previous = self._pending.pop(block, None)
            if previous is not None and _then_forget(previous) and isinstance(effect, Withdraw):
                effect = previous  # a faulty block's octets still wait for this withdrawal
            self._pending[block] = effect
        if effects:
            self._wake.set()

    async def _flush(self) -> None:
        """Send everything pending; on failure what was not sent stays pending. Batches are
        bounded in entries and octets; an entry the IS refuses is dropped (logged, counted),
        never holding the others back."""
        assert self.index is not None
        while self._pending:
            blocks: list[BlockId] = []
            octets = 0
            for block in itertools.islice(self._pending, BATCH):
                octets += _effect_octets(self._pending[block])
                if blocks and octets > BATCH_OCTETS:
                    break
                blocks.append(block)
            await self._send_batch(blocks, [self._pending[b] for b in blocks])

    async def _send_batch(self, blocks: list[BlockId], effects: list[Effect]) -> None:
        """One batch; a batch the IS refuses as a whole (4xx) is halved until the entry it
        refuses is alone, and that entry is dropped. Unreachable: raised, all kept pending."""
        assert self.index is not None
        if self.routes == "text":
            await self._send_each(blocks, effects)
            return
        put = [e.record for e in effects if isinstance(e, Publish)]
        delete = [e.ref for e in effects if not isinstance(e, Publish)]
        try:
            outcomes, _ = await self.index.batch(put, delete)
        except (NotFound, MethodNotAllowed) as exc:
            if self.routes == "batch":
                raise
            log.warning("the index has no batch route (%s): publishing with PUT and DELETE", exc)
            self.routes = "text"
            await self._send_each(blocks, effects)
            return
        except (InvalidInput, Forbidden, PayloadTooLarge, CapacityExhausted) as exc:
            if len(blocks) > 1:
                half = len(blocks) // 2
                await self._send_batch(blocks[:half], effects[:half])
                await self._send_batch(blocks[half:], effects[half:])
                return
            log.warning("index refused the update of %s: %s", block_ref(blocks[0]), exc.detail)
            self.index_refused.labels(exc.slug).inc()
        else:
            await self._granted([o.ttl_ms for o in outcomes])
        await self._sent(blocks, effects)

    async def _send_each(self, blocks: list[BlockId], effects: list[Effect]) -> None:
        """KVSP 6.1 as written: a PUT per record published, a DELETE per record withdrawn, a
        few at a time. An entry the IS refuses (4xx) is dropped; a withdrawal of a record the
        IS does not have is done; unreachable: raised, what was not sent kept pending."""
        assert self.index is not None
        index = self.index

        async def one(block: BlockId, effect: Effect) -> int | None:
            try:
                if isinstance(effect, Publish):
                    return (await index.publish(effect.record)).ttl_ms
                await index.withdraw(effect.ref)
            except NotFound:
                pass  # nothing to withdraw
            except (InvalidInput, Forbidden, PayloadTooLarge, CapacityExhausted) as exc:
                log.warning("index refused the update of %s: %s", block_ref(block), exc.detail)
                self.index_refused.labels(exc.slug).inc()
            return None

        for at in range(0, len(blocks), TEXT_CONCURRENCY):
            part = slice(at, at + TEXT_CONCURRENCY)
            answers = await asyncio.gather(
                *map(one, blocks[part], effects[part]), return_exceptions=True
            )
            done = [i for i, a in enumerate(answers) if not isinstance(a, BaseException)]
            await self._granted([a for a in answers if isinstance(a, int)])
            await self._sent([blocks[part][i] for i in done], [effects[part][i] for i in done])
            for answer in answers:
                if isinstance(answer, BaseException):
                    raise answer

    async def _granted(self, ttls: list[int]) -> None:
        """The IS granted records these TTLs: refresh early enough for the shortest."""
        if ttls:
            granted = min(ttls)
            if granted // 2 < self.store.refresh_after_ms:
                await self.call(lambda: self.store.granted(granted))

    async def _sent(self, blocks: list[BlockId], effects: list[Effect]) -> None:
        """These updates are delivered (or refused for good): no longer pending, and the
        octets of faulty blocks whose withdrawal went first are freed (KVSP 6.6)."""
        for block, effect in zip(blocks, effects, strict=True):
            if self._pending.get(block) is effect:
                del self._pending[block]
        faulty = [b for b, e in zip(blocks, effects, strict=True) if _then_forget(e)]
        if faulty:
            await self.call(lambda: self.store.forget_withdrawn(faulty))

    async def _publisher(self) -> None:
        delay = 0.1
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self.index is None:
                await self._sent(list(self._pending), list(self._pending.values()))
                continue
            try:
                await self._flush()
                delay = 0.1
            except KvspError as exc:
                log.warning("index update failed (%s); retrying in %.1f s", exc.detail, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                self._wake.set()

    async def _refresher(self) -> None:
        period = min(1.0, self.config.record_ttl_ms / 4000)
        while True:
            await asyncio.sleep(period)
            await self.call(self.store.refresh_due)

    # -- blocks --------------------------------------------------------------------------------

    def check_put(self, principal: Principal, block: BlockId) -> None:
        """What a block PUT is refused for before its body is read: the caller's scope, and
        a block held already."""
        authorize(principal, BLOCK_ROLES, scope=block[1])
        if block in self.store:
            raise AlreadyStored(f"{block_ref(block)} is already held here")

    def check_header(self, prefix: bytes) -> bool:
        """Refuse a container from its first octets (bad header, too many layers, above the
        size limit); True once the header was read whole and passed."""
        header = peek_header(prefix, self.config.max_block_octets)
        if header is None:
            return False
        if header.layer_count > self.config.max_layers:
            raise ContainerLengthError(
                f"{header.layer_count} layers; this holder stores at most {self.config.max_layers}"
            )
        return True

    async def put_block(self, principal: Principal, block: BlockId, body: bytes) -> ReplicaRecord:
        """Store a container received for ``block``: validated, digests computed here."""
        authorize(principal, BLOCK_ROLES, scope=block[1])
        self.check_header(body)
        return await self.store_block(block, body)

    async def store_block(
        self,
        block: BlockId,
        body: bytes | Container,
        placement: Sequence[tuple[Tier, tuple[int, int]]] | None = None,
        use: Callable[[BlockId], None] | None = None,
    ) -> ReplicaRecord:
        """Store a whole block's container, its octets or parsed (the holder's own blocks: no
        caller to authorize); ``AlreadyStored`` if it is held. A container this process has
        fetched and verified keeps the digests it was checked with: stored, its octets are
        copied once and hashed no more. ``placement`` is preferred where its tiers have room,
        else the block goes where the store puts it; ``use`` is called with the block, on the
        store's thread, once it is held (or if it already was)."""

        def put() -> ReplicaRecord:
            if block in self.store:  # before hashing megabytes for nothing
                if use is not None:
                    use(block)
                raise AlreadyStored(f"{block_ref(block)} is already held here")
            container = (
                body
                if isinstance(body, Container)
                else Container.parse(body, max_octets=self.config.max_block_octets)
            )
            sha256 = container.sha256()  # and, in the same pass, the layer digests for the meta
            meta = BlockMeta.of(container)
            data = container.data()
            try:
                record = self.store.put(block, meta, data, placement)
            except CapacityExhausted:
                if placement is None:
                    raise
                record = self.store.put(block, meta, data)
            self._repr[block] = sha256
            if use is not None:
                use(block)
            return record

        return await self.call(put)

    async def get_block(
        self, principal: Principal, block: BlockId, layers: tuple[int, int] | None
    ) -> tuple[BlockRead, bytes]:
        """The layers asked for, ready to send, with the SHA-256 for ``Repr-Digest``."""
        authorize(principal, BLOCK_ROLES, scope=block[1])

        def get() -> tuple[BlockRead, bytes]:
            read = self.store.get(block, *(layers or (None, None)))
            whole = read.header.first_layer == 0 and read.header.layer_count == len(
                self.store.meta(block).lengths
            )
            digest = self._repr.get(block) if whole else None
            if digest is None:
                h = hashlib.sha256(read.header.encode())
                for part in read.parts:
                    h.update(part)
                digest = h.digest()
                if whole:
                    self._repr[block] = digest
            return read, digest

        def quick() -> tuple[BlockRead, bytes] | None:
            """A whole block in host memory whose Repr-Digest is known: no I/O, no hashing."""
            return get() if block in self._repr and self.store.in_host(block) else None

        found = self._call_here(quick) if layers is None else None
        try:
            return found if found is not None else await self.call(get)
        except NotFound:
            if block not in self.store:
                self._withdraw_stale(block)
            raise

    def read_in_process(self, block: BlockId, take: Callable[[BlockRead], T]) -> T | None:
        """``take`` of a whole block held in host memory, for a client in this process on
        another thread (the vLLM connector of the vLLM-backed instance): run under the store's
        lock, so the octets cannot be reused while ``take`` copies them, each layer checked
        against its digest by the store; None when it is not all in host memory (the client
        then fetches it over HTTP). What the read left (a faulty block dropped) goes to the
        event loop."""
        with self._lock:
            if not self.store.in_host(block):
                return None
            try:
                read, effects = self._run(lambda: self.store.get(block))
                taken: T | None = take(read)
            except NotFound:
                taken, effects = None, self.store.take_effects()
        if effects and self._loop is not None:
            self._loop.call_soon_threadsafe(self._settle, None, effects)
        return taken

    def _withdraw_stale(self, block: BlockId) -> None:
        """A block asked for and not held: any record the index has of it here is stale (kept
        from before a restart, when the memory that held it was lost): withdraw it, so the next
        lookup no longer sends clients here. Withdrawing a record that is not there costs the
        IS nothing; at most ``STALE_WITHDRAWALS`` updates wait, so misses cannot pile up."""
        if self.index is not None and len(self._pending) < STALE_WITHDRAWALS:
            self._queue([Withdraw(self._ref(block))])

    # -- leases --------------------------------------------------------------------------------

    async def grant_lease(self, principal: Principal, request: LeaseRequest) -> LeaseGrant:
        """A lease on blocks named by key (KVSP 6.6), all of one scope the caller may use;
        a key not held, or held in a scope the caller may not use, is ``NotFound`` with one
        text (a block's existence is its tenant's business) and nothing is granted."""
        authorize(principal, BLOCK_ROLES)
        if request.scope_id is not None:
            authorize(principal, BLOCK_ROLES, scope=request.scope_id)

        def grant() -> LeaseGrant:
            sizes = []
            for key in dict.fromkeys(request.block_keys):
                block = self._leasable(principal, request, key)
                sizes.append((block, self.store.meta(block).size))
            if len({block[1] for block, _ in sizes}) > 1:
                raise InvalidInput("one lease covers blocks of one scope")
            return self.leases.grant(principal.name, sizes, request.ttl_ms)

        return await self.call(grant)

    def _leasable(self, principal: Principal, request: LeaseRequest, key: str) -> BlockId:
        """The block held under ``key`` that ``request`` may lease (on the store's thread)."""
        if request.compat_id is not None and request.scope_id is not None:
            return (request.compat_id, request.scope_id, key)
        missing = NotFound(f"block {key} is not held here")
        try:
            block = self.store.by_key(key)
        except NotFound:
            raise missing from None
        wanted = (request.compat_id, request.scope_id)
        if any(w is not None and w != got for w, got in zip(wanted, block, strict=False)):
            raise missing
        if not principal.may_access_scope(block[1]):
            raise missing
        return block

    async def renew_lease(self, principal: Principal, lease: str, ttl_ms: int) -> LeaseGrant:
        return await self.call(lambda: self.leases.renew(principal.name, lease, ttl_ms))

    async def release_lease(self, principal: Principal, lease: str) -> None:
        await self.call(lambda: self.leases.release(principal.name, lease))

    # -- health and metrics --------------------------------------------------------------------

    async def refresh_metrics(self) -> None:
        def read() -> _Figures:
            stats = self.store.stats
            return _Figures(
                used=self.store.used(),
                capacity=self.capacities,
                blocks=len(self.store),
                hits=stats.hits,
                misses=stats.misses,
                digest_failures=stats.digest_failures,
                evictions=dict(stats.evictions),
                demotions=dict(stats.demotions),
                lease_octets=self.leases.octets_by_scope(),
                scope_octets=self.store.used_by_scope(),
                pending=len(self._pending),
            )

        self._snapshot.figures = await self.call(read)


@dataclass(frozen=True)
class _Figures:
    used: dict[Tier, int]
    capacity: dict[Tier, int]
    blocks: int
    hits: int
    misses: int
    digest_failures: int
    evictions: dict[str, int]
    demotions: dict[str, int]
    lease_octets: dict[str, int]
    scope_octets: dict[str, int]
    pending: int


class _Snapshot:
    """The store's figures as last read on its thread, exported when Prometheus scrapes."""

    def __init__(self) -> None:
        self.figures: _Figures | None = None

    def collect(self) -> Iterator[Metric]:
        f = self.figures
        if f is None:
            return
        used = GaugeMetricFamily("kvsp_holder_bytes", "Octets held, by tier", labels=["tier"])
        cap = GaugeMetricFamily(
            "kvsp_holder_capacity_bytes", "Configured capacity, by tier", labels=["tier"]
        )
        for name, octets in f.used.items():
            used.add_metric([name], octets)
            cap.add_metric([name], f.capacity[name])
        yield used
        yield cap
        yield GaugeMetricFamily("kvsp_holder_blocks", "Blocks held", value=f.blocks)
        yield CounterMetricFamily("kvsp_holder_hits", "Block reads served", value=f.hits)
        yield CounterMetricFamily(
            "kvsp_holder_misses", "Block reads for blocks or layers not held", value=f.misses
        )
        yield CounterMetricFamily(
            "kvsp_holder_digest_failures",
            "Stored octets that failed verification (block withdrawn and dropped)",
            value=f.digest_failures,
        )
        for metric, counts, what in (
            ("evictions", f.evictions, "dropped"),
            ("demotions", f.demotions, "moved to a slower tier"),
        ):
            family = CounterMetricFamily(
                f"kvsp_holder_{metric}", f"Blocks {what} to make room, by tier", labels=["tier"]
            )
            for tier_name, count in counts.items():
                family.add_metric([tier_name], count)
            yield family
        leased = GaugeMetricFamily(
            "kvsp_holder_lease_bytes", "Octets under valid leases, by scope", labels=["scope"]
        )
        for scope, octets in f.lease_octets.items():
            leased.add_metric([scope], octets)
        yield leased
        stored = GaugeMetricFamily(
            "kvsp_holder_scope_bytes", "Octets held, every tier, by scope", labels=["scope"]
        )
        for scope, octets in f.scope_octets.items():
            stored.add_metric([scope], octets)
        yield stored
        yield GaugeMetricFamily(
            "kvsp_holder_index_pending",
            "Publishes and withdrawals not yet delivered to the Index Service",
            value=f.pending,
        )
