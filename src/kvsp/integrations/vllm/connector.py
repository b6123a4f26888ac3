"""``KVSPConnector``: vLLM's KV cache speaking KVSP.

vLLM runs one connector object per role. The **scheduler** side decides: it cuts each prompt
into Block Keys with its tenant's scope key, asks the Index Service how many of the blocks after
vLLM's own prefix-cache hit are held somewhere (``get_num_new_matched_tokens``), and, each step,
hands the worker the blocks to load into the pages vLLM allocated and the blocks whose tokens
the step completes. The **worker** side moves octets: it streams every block of the step at
once from its holders, a layer range per run of layers a holder keeps in one tier (each layer
checked against its layer digest as it completes, by ``HolderClient``, and the range handed
over once its ``Repr-Digest`` has matched too: KVSP 6.7's MUST; a record's layer digests are
checked against its replica digest, so a block whose every range passed matches that as well)
into receive buffers kept from step to step; vLLM's thread, while it waits in
``wait_for_layer_load(layer)``, writes every verified section that has arrived (of any layer)
into its paged cache, and returns as soon as that layer is in place for every block while later
layers are still in flight; and it copies the blocks a step completed out of the cache
(kvsp-layout-1), PUTs them to a holder (which publishes them to the IS) in the background.
A range that fails any digest is never written; a later holder supplies the layers not yet in
place, and a block no holder completes is, with every later block of its request, reported
through ``get_block_ids_with_load_errors`` so that vLLM recomputes them (run vLLM with
``kv_load_failure_policy = "recompute"``). A save that fails costs only a later miss.

The load path is synchronous from vLLM's point of view (sync loading, layer-pipelined), which
keeps vLLM's request states simple: a request never waits for remote KV between steps.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections import deque
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvsp.core.container import Container, ContainerHeader
from kvsp.core.problems import (
    AlreadyStored,
    ConfigurationError,
    ContainerError,
    InvalidInput,
    KvspError,
)
from kvsp.core.records import LookupRequest, ReplicaRecord
from kvsp.core.registries import CODEC_RAW
from kvsp.core.shared import scope_runs
from kvsp.holder import local as local_holders
from kvsp.holder.blocks import MAX_BLOCK_OCTETS
from kvsp.holder.client import HolderClient, fetchable
from kvsp.holder.store import BlockRead
from kvsp.index.client import IndexClient
from kvsp.integrations.vllm.connector_events import HolderStores, stored_events
from kvsp.integrations.vllm.events import KvEventSubscriber
from kvsp.integrations.vllm.g1 import G1Pages
from kvsp.integrations.vllm.hints import ConnectorHints, request_hints
from kvsp.integrations.vllm.layout import CpuPagedCache
from kvsp.integrations.vllm.loop import LoopThread
from kvsp.integrations.vllm.plans import (
    BlockLoad,
    RequestPlan,
    TrackedRequest,
    check_block_sizes,
    fetch_ranges,
)
from kvsp.integrations.vllm.settings import ConnectorSettings
from kvsp.integrations.vllm.stats import ConnectorTally, KVSPConnectorStats, KVSPPromMetrics
from kvsp.integrations.vllm.stored import HolderPages
from kvsp.kvevents.wire import external_hash

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KVSPConnector", "KVSPConnectorMetadata"]

log = logging.getLogger("kvsp.vllm")
_LAYER = re.compile(r"layers\.(\d+)\.")
#: saves in flight at most; past it a completed block is not saved (a later miss, no harm)
_MAX_PENDING_SAVES = 512
#: connections to each holder (32 and 128 measured alike for a 2,048-token prompt)
_CONNECTIONS = 32
#: requests whose hints are still running, at most; past it a request's hints are refused
_MAX_HINT_RUNS = 64
#: receive buffers kept between steps (octets)
_KEPT_BUFFER_OCTETS = 256 << 20


@dataclass
class KVSPConnectorMetadata(KVConnectorMetadata):
    """What the worker does this step."""

    plans: tuple[RequestPlan, ...] = ()


class _BufferPool:
    """Receive buffers reused from step to step: a block lands in memory that is already mapped
    and touched (a fresh buffer per block costs more than receiving into it). At most
    ``keep_octets`` are kept."""

    def __init__(self, keep_octets: int) -> None:
        self._keep = keep_octets
        self._free: list[memoryview] = []
        self._lock = threading.Lock()  # taken on the loop thread, given back on vLLM's

    def take(self, octets: int) -> memoryview:
        with self._lock:
            while self._free:
                buffer = self._free.pop()
                if len(buffer) >= octets:
                    return buffer
        return memoryview(bytearray(octets))

    def fill(self, octets: int, count: int) -> None:
        """Allocate ``count`` buffers of ``octets`` now (as many as are kept): a buffer is
        zeroed, so mapped, when it is made, which the first loads would otherwise pay for."""
        self.give([memoryview(bytearray(octets)) for _ in range(min(count, self._keep // octets))])

    def give(self, buffers: Sequence[memoryview]) -> None:
        with self._lock:
            kept = sum(len(b) for b in self._free)
            for buffer in buffers:
                if kept + len(buffer) > self._keep:
                    return
                self._free.append(buffer)
                kept += len(buffer)


class _Abandoned(Exception):
    """A block load stopped because its request no longer needs it."""


def _layer_index(name: str) -> int:
    found = _LAYER.search(name)
    if found is None:
        raise ConfigurationError(f"cannot tell the layer number of vLLM layer {name!r}")
    return int(found.group(1))


def _holders_first(records: Sequence[ReplicaRecord], near: str | None) -> tuple[ReplicaRecord, ...]:
    """Records kvsp can fetch, the configured (nearby) holder's first; the IS's order
    otherwise."""
    return tuple(sorted(fetchable(records), key=lambda r: r.holder != near))


@dataclass
class _LoadRun:
    """The loads of one step, shared by the connector's loop thread (which receives) and vLLM's
    thread (which writes into the pages). Per layer: how many blocks have not yet handed that
    layer over (or given up); the verified layer runs in order of arrival; an event set at every
    change; per request, the first block that failed."""

    plans: tuple[RequestPlan, ...]
    layers: int
    remaining: list[int] = field(default_factory=list)
    #: verified runs of layers waiting to be written: (first layer, page, offset, their octets)
    arrived: deque[tuple[int, int, int, memoryview]] = field(default_factory=deque)
    news: threading.Event = field(default_factory=threading.Event)
    failed: dict[str, int] = field(default_factory=dict)
    #: receive buffers taken from the pool, given back once nothing views them
    buffers: list[memoryview] = field(default_factory=list)
    cancelled: bool = False
    future: Future[None] | None = None

    def __post_init__(self) -> None:
        self.remaining = [sum(len(p.loads) for p in self.plans)] * self.layers

    def hand_over(self, first: int, last: int, page: int, offset: int, octets: memoryview) -> None:
        """One block's verified layers ``first..last`` (their sections as in the container)."""
        self.arrived.append((first, page, offset, octets))
        self.settled(first, last)

    def settled(self, first: int, last: int) -> None:
        """One block's layers ``first..last`` were handed over, or never will be."""
        for layer in range(first, last + 1):
            self.remaining[layer] -= 1
        self.news.set()

    def fail(self, plan: RequestPlan, index: int) -> None:
        self.failed[plan.request] = min(index, self.failed.get(plan.request, index))

    def live(self, plan: RequestPlan, index: int) -> bool:
        return not self.cancelled and index < self.failed.get(plan.request, len(plan.loads))

    def give_up(self) -> None:
        """Every load fails (recomputed), and nothing waits any longer."""
        self.cancelled = True
        for plan in self.plans:
            self.fail(plan, 0)
        self.news.set()

    def error_pages(self, page_tokens: int) -> set[int]:
        """vLLM blocks holding a failed block or any later loaded block of its request."""
        pages: set[int] = set()
        for plan in self.plans:
            first = self.failed.get(plan.request)
            if first is None or not plan.loads:
                continue
            start = plan.loads[first].first_token // page_tokens
            end = (plan.loads[-1].first_token // page_tokens) + 1
            pages.update(plan.pages[start:end])
        return pages


class KVSPConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.P2P

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        model = vllm_config.model_config
        self.settings = ConnectorSettings.parse(extra, str(model.model))
        d = self.settings.descriptor
        self.block_tokens = d.block_tokens
        self.page_tokens = int(vllm_config.cache_config.block_size)
        self._max_tokens = int(model.max_model_len)
        check_block_sizes(self.block_tokens, self.page_tokens)
        hf = model.hf_config
        heads = int(hf.num_attention_heads)
        head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // heads)
        found = (int(hf.num_hidden_layers), int(hf.num_key_value_heads), head_dim, model.dtype)
        if found != (d.layers, d.kv_heads, d.head_dim, torch.float32) or d.kv_dtype != "float32":
            raise ConfigurationError(
                f"vLLM runs layers, KV heads, head dim, dtype {found}; the kvsp descriptor "
                f"says {(d.layers, d.kv_heads, d.head_dim, d.kv_dtype)}: not the same cache"
            )
        self.compat = d.compat_id()
        self.compat_hex = self.compat.hex()
        self.geometry = d.geometry
        self._section_octets = d.block_tokens * d.kv_heads * d.head_dim * d.geometry.element.size
        self._loop = LoopThread(f"kvsp-{role.name.lower()}")
        self._index: IndexClient | None = None
        self._holders: HolderClient | None = None
        # scheduler side
        self._tracked: dict[str, TrackedRequest] = {}
        self._requests: dict[str, Request] = {}
        #: the KVSP blocks in vLLM's pages, from vLLM's KV events (when it publishes them)
        self.g1 = G1Pages(4 * max(int(kv_cache_config.num_blocks), 1024))
        #: pages stored at the holder, announced through vLLM's publisher (``take_events``)
        self.at_holder = HolderPages(4 * max(int(kv_cache_config.num_blocks), 1024))
        self._events: KvEventSubscriber | None = None
        self._hints: ConnectorHints | None = None
        self._hint_runs: set[Future[Any]] = set()
        events = vllm_config.kv_events_config
        if (
            role == KVConnectorRole.SCHEDULER
            and events is not None
            and events.enable_kv_cache_events
            and events.publisher == "zmq"
        ):
            self._events = KvEventSubscriber(events.endpoint, self.g1, events.topic)
        # worker side
        self._cache: CpuPagedCache | None = None
        self._names: dict[str, int] = {}
        self._run: _LoadRun | None = None
        self._staged: dict[tuple[str, str, str], dict[int, tuple[Any, Any]]] = {}
        self._buffers = _BufferPool(_KEPT_BUFFER_OCTETS)
        self._saves: set[Future[None]] = set()
        self._save_lock = threading.Lock()
        #: hashes of the blocks stored at the holder since the last report to the scheduler
        self._stored: list[int] = []
        #: what this worker loaded and stored, for vLLM's ``/metrics`` (``stats.py``)
        self._tally = ConnectorTally()
        if role == KVConnectorRole.SCHEDULER:
            self._warm()

    # -- clients ----------------------------------------------------------------------------------

    def _index_client(self) -> IndexClient:
        if self._index is None:
            s = self.settings
            self._index = IndexClient(s.index_url, s.token, timeout_s=s.timeout_s)
        return self._index

    def _holder_client(self) -> HolderClient:
        if self._holders is None:
            s = self.settings
            self._holders = HolderClient(s.token, timeout_s=s.timeout_s, connections=_CONNECTIONS)
        return self._holders

    def _warm(self) -> None:
        """Open the connection the first lookup would otherwise wait for."""
        try:
            self._loop.run(self._index_client().health(), self.settings.timeout_s)
        except (KvspError, TimeoutError) as exc:
            log.warning("index service not reachable yet: %s", exc)

    # -- scheduler side ---------------------------------------------------------------------------

    def _track(self, request: Request) -> TrackedRequest | None:
        tracked = self._tracked.get(request.request_id)
        if tracked is not None:
            return tracked
        params: Mapping[str, Any] | None = request.kv_transfer_params
        tenant = self.settings.tenant_of(params)
        if tenant is None:
            return None
        given: Sequence[str] = ()
        kvsp = params.get("kvsp") if params is not None else None
        if self.settings.request_tenants and isinstance(kvsp, Mapping):
            keys = kvsp.get("prefix_keys", ())
            if isinstance(keys, list | tuple) and all(isinstance(k, str) for k in keys):
                given = tuple(keys)
        try:
            tracked = TrackedRequest.start(tenant, self.compat, self.block_tokens, given)
        except InvalidInput as exc:  # a malformed prefix key: this request gets no KVSP
            log.warning("request %s: %s", request.request_id, exc)
            return None
        self._tracked[request.request_id] = tracked
        self._requests[request.request_id] = request
        return tracked

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tracked = self._track(request)
        if tracked is None:
            return 0, False
        if tracked.lookup is None or tracked.lookup[0] != num_computed_tokens:
            tracked.lookup = (
                num_computed_tokens,
                self._lookup(tracked, request, num_computed_tokens),
            )
        return len(tracked.lookup[1]) * self.block_tokens, False

    def _lookup(
        self, tracked: TrackedRequest, request: Request, computed: int
    ) -> tuple[BlockLoad, ...]:
        wanted = tracked.wanted(list(request.prompt_token_ids or ()), computed)
        first = computed // self.block_tokens
        near = self.settings.holder_url
        found: list[BlockLoad] = []
        for scope, part in scope_runs(wanted, tracked.scope_of, first):  # a shared prefix's first
            query = LookupRequest(scope_id=scope, compat_id=self.compat_hex, block_keys=tuple(part))
            try:
                answer = self._loop.run(self._index_client().lookup(query), self.settings.timeout_s)
            except (KvspError, TimeoutError) as exc:
                log.warning("index lookup failed, computing the prompt: %s", exc)
                break
            usable = [_holders_first(records, near) for records in answer.replicas]
            loadable = next((i for i, r in enumerate(usable) if not r), len(usable))
            found += [BlockLoad(key, 0, r) for key, r in zip(part, usable[:loadable], strict=False)]
            if loadable < len(part):  # chained keys: nothing after a block kvsp cannot fetch
                break
        return tuple(found)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            return
        computed = tracked.lookup[0] if tracked.lookup is not None else request.num_computed_tokens
        tracked.allocated(computed, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        scheduled = scheduler_output.num_scheduled_tokens
        steps = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        steps += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        plans = []
        for request_id, computed in steps:
            tracked = self._tracked.get(request_id)
            request = self._requests.get(request_id)
            if tracked is None or request is None:
                continue
            done = computed + scheduled.get(request_id, 0)
            if self._events is not None:
                self._key_pages(tracked, request)
            loads, saves = tracked.step(request.all_token_ids, done)
            if self.settings.holder_url is None:
                saves = []
            if loads or saves:
                assert self._kv_cache_manager is not None, "vLLM binds its cache manager first"
                (pages,) = self._kv_cache_manager.get_block_ids(request_id)
                plans.append(
                    RequestPlan(
                        request_id,
                        self.compat_hex,
                        tuple(pages),
                        loads,
                        tuple(saves),
                    )
                )
        return KVSPConnectorMetadata(tuple(plans))

    def _key_pages(self, tracked: TrackedRequest, request: Request) -> None:
        """Tell ``g1`` which KVSP blocks fill each of the request's full pages, by the page hash
        vLLM's events name them with."""
        hashes = request.block_hashes
        tokens = request.all_token_ids
        pages = tracked.full_pages(tokens, len(hashes), self.page_tokens)
        n = self.page_tokens
        for page, blocks in pages:
            page_hash = maybe_convert_block_hash(hashes[page])
            self.g1.record(page_hash, [(self.compat_hex, scope, key) for scope, key in blocks])
            if self.settings.holder_url is not None:
                parent = maybe_convert_block_hash(hashes[page - 1]) if page else None
                self.at_holder.record(
                    page_hash, parent, tokens[page * n : (page + 1) * n],
                    [external_hash(bytes.fromhex(key)) for _, key in blocks],
                )  # fmt: skip

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        stores = connector_output.kv_cache_events
        if isinstance(stores, HolderStores):
            self.at_holder.stored(stores.aggregate().blocks())
        invalid = connector_output.invalid_block_ids
        if not invalid or self._kv_cache_manager is None:
            return
        for request_id, tracked in self._tracked.items():
            if tracked.loaded_tokens:
                (pages,) = self._kv_cache_manager.get_block_ids(request_id)
                tracked.load_failed(pages, invalid, self.page_tokens)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The pages now wholly stored at the holder (``stored.py``), for vLLM's publisher."""
        return stored_events(self.at_holder.take(), self.page_tokens)

    def get_kv_connector_kv_cache_events(self) -> HolderStores | None:
        """The blocks this worker stored at the holder since its last report."""
        with self._save_lock:
            stored, self._stored = self._stored, []
        return HolderStores(stored, self.block_tokens) if stored else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This worker's loads and stores since its last report (vLLM's ``/metrics``)."""
        return self._tally.take()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVSPConnectorStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVSPPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:
            return False, None
        answer: dict[str, Any] = {"loaded_tokens": tracked.loaded_tokens}
        if self.settings.request_hints:
            said = self._run_hints(tracked, request)
            if said is not None:
                answer["kv_hints"] = said
        return False, {"kvsp": answer}

    def _hint_executor(self) -> ConnectorHints:
        if self._hints is None:
            s = self.settings
            self._hints = ConnectorHints(
                self.compat_hex, s.holder_url, self.g1, self._index_client(), self._holder_client()
            )
        return self._hints

    def _run_hints(self, tracked: TrackedRequest, request: Request) -> dict[str, Any] | None:
        """Remember the session's blocks; start the hints the request carries, if any, on the
        loop. What the answer says of them: the envelope taken, or why not."""
        tenant = self.settings.tenant_of(request.kv_transfer_params)
        if tenant is None:
            return None
        hints, refused = request_hints(request.kv_hints, request.kv_transfer_params)
        if request.session_id is None and hints is None and refused is None:
            return None  # nothing to remember, nothing to run
        executor = self._hint_executor()
        tokens = request.all_token_ids
        keys = tracked.keys(tokens)
        blocks = [(self.compat_hex, tracked.scope_of(i), k) for i, k in enumerate(keys)]
        if request.session_id is not None:
            executor.served(tenant, request.session_id, blocks)
        if refused is not None:
            log.warning("request %s: KvHints refused: %s", request.request_id, refused)
            return {"refused": refused}
        if hints is None:
            return None
        self._hint_runs = {f for f in self._hint_runs if not f.done()}
        if len(self._hint_runs) >= _MAX_HINT_RUNS:
            log.warning("request %s: too many KvHints running; not run", request.request_id)
            return {"message_id": hints.message_id, "refused": "too many hint runs in flight"}
        computed = min(request.num_computed_tokens, len(tokens)) // self.block_tokens
        last = blocks[computed - 1] if computed and self.settings.holder_url else None
        run = executor.run(hints.message_id, executor.plan(tenant, hints), last)
        self._hint_runs.add(self._loop.submit(run))
        return {"message_id": hints.message_id, "actions": len(hints.actions)}

    # -- worker side: registration and loads -------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        g = self.geometry
        layers: dict[int, torch.Tensor] = {}
        for name, cache in kv_caches.items():
            if cache.dtype != torch.float32 or cache.device.type != "cpu":
                raise ConfigurationError(
                    f"KVSPConnector needs vLLM's CPU float32 KV cache, got {cache.dtype} on "
                    f"{cache.device}"
                )
            index = _layer_index(name)
            self._names[name] = index
            layers[index] = cache
        if sorted(layers) != list(range(g.layers)):
            raise ConfigurationError(f"vLLM registered layers {sorted(layers)}")
        self._cache = CpuPagedCache([layers[i] for i in range(g.layers)], g.kv_heads, g.head_dim)
        if self._cache.block_size != self.page_tokens:
            raise ConfigurationError("vLLM's KV cache pages do not have the configured size")
        log.info("vLLM's KV cache layers are seen through %d view(s)", self._cache.views)
        pair = (self._section_octets, self._section_octets)
        whole = ContainerHeader(CODEC_RAW, 0, self.block_tokens, (pair,) * g.layers)
        self._buffers.fill(whole.total_octets, -(-self._max_tokens // self.block_tokens))

    def _metadata(self) -> KVSPConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVSPConnectorMetadata)
        return meta

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plans = tuple(p for p in self._metadata().plans if p.loads)
        if not plans:
            return
        run = _LoadRun(plans, self.geometry.layers)
        self._run = run
        run.future = self._loop.submit(self._load(run))

    async def _load(self, run: _LoadRun) -> None:
        """Every block streamed at once; each layer is handed over as soon as it has arrived and
        matched its layer digest, so the first layers are ready while the last are in flight.
        vLLM's thread writes them into its pages (``_place``) while this loop receives more."""
        jobs = [(plan, i, load) for plan in run.plans for i, load in enumerate(plan.loads)]
        try:
            await asyncio.gather(*(self._load_block(run, *job) for job in jobs))
        except BaseException:
            run.give_up()
            raise

    async def _load_block(
        self, run: _LoadRun, plan: RequestPlan, index: int, load: BlockLoad
    ) -> None:
        """One block into its page, layer range by layer range, from the first holder that
        serves it intact (a later holder takes over from the first layer not yet in place)."""
        g = self.geometry
        page, offset = plan.page_of(load.first_token, self.page_tokens)
        done = 0  # layers 0..done-1 are handed over
        for record in load.records:
            local = self._read_local(record) if self.settings.local_reads else None
            taken = None if local is None else await local
            if taken is not None:
                buffer, octets = taken
                run.buffers.append(buffer)
                self._tally.add(blocks_loaded=1, bytes_loaded=octets, blocks_loaded_locally=1)
                if run.live(plan, index):
                    run.hand_over(0, g.layers - 1, page, offset, buffer[:octets])
                else:
                    run.settled(0, g.layers - 1)
                return
            try:
                for first, last in fetch_ranges(record, done, self.settings.layer_chunk):
                    if record.size > MAX_BLOCK_OCTETS:  # a record's size alone allocates nothing
                        raise ContainerError(f"replica of {record.size} octets is too large")
                    buffer = self._buffers.take(record.size)
                    run.buffers.append(buffer)
                    start = 0  # where layer ``first`` lies in the buffer
                    got = first  # layers first..got-1 arrived and matched their digests
                    async for layer in self._holder_client().stream(record, (first, last), buffer):
                        if not run.live(plan, index):
                            raise _Abandoned
                        if {len(layer.k), len(layer.v)} != {self._section_octets}:
                            raise ContainerError(f"layer sections of {len(layer.k)} octets")
                        if layer.layer == first:
                            start = layer.offset
                        got = layer.layer + 1
                    # the stream ended: Repr-Digest matched too (KVSP 6.7); only now is the
                    # range used
                    if got != last + 1:
                        raise ContainerError(f"layers {first}-{last} did not all come")
                    end = start + (got - first) * 2 * self._section_octets
                    run.hand_over(first, last, page, offset, buffer[start:end])
                    self._tally.add(bytes_loaded=end - start)
                    done = got
                self._tally.add(blocks_loaded=1)
                return
            except _Abandoned:
                break
            except KvspError as exc:
                log.warning("block %s from %s not loaded: %s", load.key[:16], record.holder, exc)
                if done == g.layers:  # every layer matched its layer digest and is handed over
                    self._tally.add(blocks_loaded=1)
                    return
        else:  # no holder served it intact (an abandoned request's block is no failure)
            self._tally.add(load_failures=1)
        run.fail(plan, index)
        if done < g.layers:
            run.settled(done, g.layers - 1)

    def _read_local(self, record: ReplicaRecord) -> Awaitable[tuple[memoryview, int] | None] | None:
        """The block's layer sections from a holder in this process, copied into a receive
        buffer on a worker thread: the buffer and how many octets (None: no such holder; the
        awaitable gives None when the block is not all in host memory there, or not in the raw
        layout)."""
        holder = local_holders.find(record.holder)
        if holder is None:
            return None
        block = (record.compat_id, record.scope_id, record.block_key)
        pair = (self._section_octets, self._section_octets)

        def take(read: BlockRead) -> tuple[memoryview, int] | None:
            h = read.header
            if (
                len(read.parts) != 1
                or h.codec != CODEC_RAW
                or h.token_count != self.block_tokens
                or h.lengths != (pair,) * self.geometry.layers
            ):
                return None
            octets = read.parts[0]
            buffer = self._buffers.take(len(octets))  # what the store holds, not what a record says
            buffer[: len(octets)] = octets
            return buffer, len(octets)

        loop = asyncio.get_running_loop()
        return loop.run_in_executor(None, holder.read_in_process, block, take)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Return once ``layer`` is in place for every block. Meanwhile vLLM's thread, which
        would only wait, writes whatever has arrived, for any layer."""
        run = self._run
        if run is None:
            return
        layer = self._names[layer_name]
        deadline = time.monotonic() + self.settings.timeout_s
        while True:
            run.news.clear()
            done = run.remaining[layer] <= 0  # then every section of the layer is in `arrived`
            self._place(run)
            if done or run.cancelled:
                return
            if not run.news.wait(deadline - time.monotonic()):
                log.error("KV load timed out; the blocks are recomputed")
                run.give_up()

    def _place(self, run: _LoadRun) -> None:
        """Write the layer runs that have arrived into vLLM's pages."""
        assert self._cache is not None
        arrived = run.arrived
        while arrived:
            first, page, offset, octets = arrived.popleft()
            if not run.cancelled:
                self._cache.write(first, page, offset, self.block_tokens, octets)

    def _settle(self, run: _LoadRun) -> bool:
        """Wait until every load of the step has ended (placed or failed); False if they did
        not end in time (they go on, and their buffers are not reused)."""
        if run.future is not None:
            try:
                run.future.result(self.settings.timeout_s)
            except Exception as exc:  # the loads failed as a whole; the blocks are recomputed
                log.error("KV load failed: %r", exc)
                run.give_up()
        return run.future is None or run.future.done()

    def get_block_ids_with_load_errors(self) -> set[int]:
        run, self._run = self._run, None
        if run is None:
            return set()
        ended = self._settle(run)
        self._place(run)  # layers no forward waited for
        if ended:
            self._buffers.give(run.buffers)
        errors = run.error_pages(self.page_tokens)
        if errors:
            log.warning("%d vLLM blocks failed to load; vLLM recomputes them", len(errors))
        return errors

    # -- worker side: saves ----------------------------------------------------------------------

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        index = self._names.get(layer_name)
        if index is None or self._cache is None:
            return
        for plan in self._metadata().plans:
            for save in plan.saves:
                page, offset = plan.page_of(save.first_token, self.page_tokens)
                block = (plan.compat_id, save.scope_id, save.key)
                self._staged.setdefault(block, {})[index] = self._cache.read(
                    index, page, offset, self.block_tokens
                )

    def wait_for_save(self) -> None:
        staged, self._staged = self._staged, {}
        layers = self.geometry.layers
        for block, sections in staged.items():
            if len(sections) != layers:
                continue
            container = Container.build(
                0, self.block_tokens, [sections[i] for i in range(layers)], geometry=self.geometry
            )
            with self._save_lock:
                if len(self._saves) >= _MAX_PENDING_SAVES:
                    log.warning("too many saves in flight; block %s not saved", block[2][:16])
                    continue
                future = self._loop.submit(self._put(block, container))
                self._saves.add(future)
            future.add_done_callback(self._saved)

    async def _put(self, block: tuple[str, str, str], container: Container) -> None:
        """Store the block at the holder and at every copy holder."""
        s = self.settings
        assert s.holder_url is not None
        await asyncio.gather(
            *(self._put_one(url, block, container) for url in (s.holder_url, *s.copy_urls))
        )

    async def _put_one(
        self, holder: str, block: tuple[str, str, str], container: Container
    ) -> None:
        try:
            await self._holder_client().put(holder, block, container)
        except AlreadyStored:
            pass
        except KvspError as exc:
            log.warning("block %s not saved at %s: %s", block[2][:16], holder, exc)
            self._tally.add(store_failures=1)
            return
        self._tally.add(blocks_stored=1, bytes_stored=container.size)
        if holder == self.settings.holder_url:
            with self._save_lock:
                self._stored.append(external_hash(bytes.fromhex(block[2])))

    def _saved(self, future: Future[None]) -> None:
        with self._save_lock:
            self._saves.discard(future)

    def flush(self) -> None:
        """Wait for the saves and hint runs in flight (a process about to exit keeps its last
        blocks and carries out the hints it took)."""
        with self._save_lock:
            pending: list[Future[Any]] = [*self._saves, *self._hint_runs]
        for future in pending:
            try:
                future.result(self.settings.timeout_s)
            except Exception as exc:  # a save that failed was logged; nothing else to do
                log.debug("save ended with %r", exc)

    def shutdown(self) -> None:
        self.flush()
        if self._events is not None:
            self._events.close()

        async def close() -> None:
            for client in (self._index, self._holders):
                if client is not None:
                    await client.aclose()

        try:
            self._loop.run(close(), 5)
        finally:
            self._loop.close()
