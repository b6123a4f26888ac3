"""A discrete-event cluster in virtual time over the real control-plane code.

What is real (the same code the services run): each instance's KV pool is a ``BlockStore`` with
a ``device`` (G1) and a ``host`` (G2) tier, LRU with retention priorities, demotion before
drops, reference counts of blocks in use (``BlockRefs``) and session pins (``PinTable``); every
effect of every store (instances' and standalone holders', which receive a copy of every block
an instance computes) goes into one ``ReplicaTable`` (the Index Service's state) as publishes
and withdrawals; the KVSP policies place with ``controller.placement.place`` over Instance
Status Records and the index's replica summaries, and estimate fetches with ``core/cost.py``;
KvHints are planned by the controller's ``SessionHintTable`` and carried out by the instance's
``LocalHints``. All of it reads one ``ManualClock``.

What is modelled: the octets (a simulated tier keeps sizes only), and time. Each instance
prefills one request at a time, first come first served: a request starts when the instance is
free and, with prefetch, when its remote blocks have arrived (the fetch overlaps the wait). Its
service time is the copy of its G2 blocks to G1 (``host_read_mbit_per_s``), the engine turning
every reused block into its cache (``import_mbit_per_s``; 0 for engines that use pages in
place), the fetch when it did not prefetch (a fetch is never faster than the instance's
``ingress_mbit_per_s``), its unmatched tokens at ``prefill_tokens_per_s`` plus
``attention_ns_per_pair`` for each pair of a new token and a token it attends to, and the
per-request ``overhead_ms``; TTFT is the end of that prefill. Decoding runs beside prefill (a
batch whose step is ``decode_step_ms`` plus ``decode_ms_per_gbyte`` per GB of KV in the batch,
fixed when the request joins it) and only decides how long the request's blocks stay in use.
Store changes happen when they would in an instance: reused and fetched blocks at placement,
computed blocks at the end of prefill. A failed instance loses its blocks (withdrawn) and its
requests not yet past prefill are placed again at the moment of failure, their TTFT still
counted from their arrival.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvsp.controller.hints import PinOrDemote, PlannedHint, SessionHintTable
from kvsp.core.clock import ManualClock
from kvsp.core.hints import ActionType, HintAction, action_name, parse_payload
from kvsp.core.keys import scope_id
from kvsp.core.problems import AlreadyStored, CapacityExhausted
from kvsp.core.records import InstanceState, InstanceStatusRecord, Link
from kvsp.core.registries import CODEC_RAW
from kvsp.holder.blocks import BlockId, BlockMeta
from kvsp.holder.store import BlockStore, Effect, Protected, Publish, Span, TierSpec
from kvsp.index.replicas import ReplicaTable
from kvsp.index.rules import IndexLimits
from kvsp.instance.hints import HintLimits, LocalHints, PinTable
from kvsp.instance.kvpool import BlockRefs
from kvsp.sim.scenario import Scenario
from kvsp.sim.workload import SimRequest, tenant_scope_key

__all__ = ["Choice", "Cluster", "Policy", "RequestResult", "SimInstance", "SizedTier"]


class SizedTier:
    """A tier that keeps no octets (the store still accounts every octet of every range)."""

    def accepts(self, meta: BlockMeta, span: Span) -> bool:
        return True

    def write(
        self, block: BlockId, meta: BlockMeta, span: Span, data: Sequence[memoryview]
    ) -> None:
        return None

    def read(self, block: BlockId, meta: BlockMeta, stored: Span, span: Span) -> memoryview:
        return memoryview(b"")

    def delete(self, block: BlockId) -> None:
        return None


@dataclass
class Node:
    """An instance or a standalone holder: one store, published under ``url``."""

    index: int
    url: str
    store: BlockStore


class SimInstance(Node):
    def __init__(
        self, index: int, url: str, store: BlockStore, refs: BlockRefs, pins: PinTable
    ) -> None:
        super().__init__(index, url, store)
        self.refs = refs
        self.pins = pins
        self.hints = LocalHints(store, pins, pins.limits, None)
        self.alive = True
        #: when the prefill server is next free (µs)
        self.free_at = 0.0
        #: prefill ends of admitted requests (µs), for the queue length
        self.ends: list[float] = []
        self.decoding = 0
        self.batch_octets = 0
        self.status_record: InstanceStatusRecord | None = None

    def queued(self, now_us: float) -> int:
        ends = self.ends
        while ends and ends[0] <= now_us:
            heapq.heappop(ends)
            self.status_record = None
        return len(ends)


@dataclass(slots=True)
class Choice:
    """Where a request runs and what it reuses beyond the instance's own prefix."""

    instance: SimInstance
    #: leading blocks usable there (resident or fetched), when the policy loads remote blocks
    usable_blocks: int | None = None
    fetch_us: float = 0.0
    fetch_octets: int = 0
    #: the policy sent a prefetch directive at placement (the fetch overlaps the queue)
    prefetch: bool = False


class Policy(Protocol):
    name: str
    #: every previously seen block is reusable anywhere at no cost (the upper bound)
    infinite_cache: bool
    #: send KvHints as sessions' turns end
    hints: bool

    def choose(self, cluster: Cluster, request: SimRequest, blocks: list[BlockId]) -> Choice: ...


@dataclass(slots=True)
class RequestResult:
    arrival_us: float
    ttft_us: float
    queue_us: float
    prompt_tokens: int
    reused_tokens: int
    fetched_octets: int
    g2_octets: int
    instance: int
    failed_over: bool


@dataclass(slots=True)
class _Admission:
    request: SimRequest
    blocks: list[BlockId]
    instance: SimInstance
    failed_over: bool
    #: leading blocks it reuses (resident or fetched)
    reused: int = 0
    #: how long it waited for the instance (µs)
    queue_us: float = 0.0
    fetched_octets: int = 0
    g2_octets: int = 0
    #: KV octets it adds to its instance's decode batch
    context: int = 0
    done: bool = False
    #: the blocks it uses at its instance (released when it ends)
    acquired: list[BlockId] = field(default_factory=list)


_ARRIVE, _START, _FAIL, _PREFILLED, _DECODED = range(5)


@dataclass
class Counters:
    hints: dict[str, int] = field(default_factory=dict)
    failovers: int = 0
    uncached_blocks: int = 0


class Cluster:
    def __init__(self, scenario: Scenario, policy: Policy, mean_prompt_tokens: float) -> None:
        self.scenario = scenario
        self.policy = policy
        self.clock = ManualClock()
        model, spec = scenario.model, scenario.instances
        self.compat = model.compat_id.hex()
        ttl = scenario.controller.record_ttl_ms
        self.index = ReplicaTable(
            self.clock,
            IndexLimits(max_ttl_ms=ttl, max_records=1 << 40, max_instances=1 << 20),
            render_at_publish=False,
        )
        section = model.section_octets
        self.meta = BlockMeta(
            CODEC_RAW,
            model.block_tokens,
            ((section, section),) * model.layers,
            (bytes(32),) * model.layers,
        )
        self.data_octets = self.meta.range_octets(0, model.layers - 1)
        # one zero buffer stands for every block's octets (untouched pages cost no memory)
        self._data = np.zeros(self.data_octets, dtype=np.uint8).data.cast("B")
        self.mean_service_us = scenario.controller.mean_service_ms * 1e3 or (
            1e6 * mean_prompt_tokens / spec.prefill_tokens_per_s
        )
        limits = HintLimits(
            pin_session_bytes=64 * self.meta.size, pin_total_bytes=spec.g1_blocks * self.meta.size
        )
        self.instances: list[SimInstance] = []
        for i in range(spec.count):
            url = f"http://instance-{i}.sim/"
            refs, pins = BlockRefs(), PinTable(self.clock, limits)
            tiers = [
                TierSpec("device", spec.g1_blocks * self.data_octets),
                TierSpec("host", spec.g2_blocks * self.data_octets, spec.host_read_mbit_per_s),
            ]
            store = self._store(tiers, url, Protected(refs, pins))
            self.instances.append(SimInstance(i, url, store, refs, pins))
        self.holders: list[Node] = []
        for h in range(scenario.holders.count):
            url = f"http://holder-{h}.sim/"
            capacity = scenario.holders.blocks * self.data_octets
            tiers = [TierSpec("host", capacity, scenario.holders.read_mbit_per_s)]
            self.holders.append(Node(spec.count + h, url, self._store(tiers, url, BlockRefs())))
        self.nodes: dict[str, Node] = {n.url: n for n in [*self.instances, *self.holders]}
        self._links = [self._links_of(inst) for inst in self.instances]
        self.hint_table = SessionHintTable(PinOrDemote())
        self.scopes: dict[int, str] = {}
        self.seen: set[BlockId] = set()  # the infinite cache of the oracle
        self.results: list[RequestResult] = []
        self.counters = Counters()
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = itertools.count()
        self._actions = itertools.count()
        self.now_us = 0.0
        for moment in scenario.starts:
            self.instances[moment.instance].alive = False
            self._push(moment.at_ms * 1e3, _START, moment.instance)
        for moment in scenario.failures:
            self._push(moment.at_ms * 1e3, _FAIL, moment.instance)

    def _store(self, tiers: list[TierSpec], url: str, protected: Any) -> BlockStore:
        ttl = self.scenario.controller.record_ttl_ms
        data = {t.name: SizedTier() for t in tiers}
        return BlockStore(tiers, data, protected, self.clock, url, ttl)

    def _links_of(self, inst: SimInstance) -> tuple[Link, ...]:
        links = []
        for node in self.nodes.values():
            if node is not inst:
                rate, rtt = self.scenario.link(inst.index, node.index)
                links.append(Link.model_construct(holder=node.url, mbit_per_s=rate, rtt_us=rtt))
        return tuple(links)

    # -- state the policies read ---------------------------------------------------------------

    def active(self) -> list[SimInstance]:
        return [i for i in self.instances if i.alive]

    def status(self, inst: SimInstance) -> InstanceStatusRecord:
        """The instance's current Instance Status Record (rebuilt only when it changed)."""
        queued = inst.queued(self.now_us)
        if inst.status_record is None:
            spec = self.scenario.instances
            g1 = spec.g1_blocks * self.data_octets
            in_use = inst.refs.leased_count() * self.data_octets
            inst.status_record = InstanceStatusRecord.model_construct(
                instance=inst.url,
                epoch=1,
                state=InstanceState.ACTIVE,
                running=inst.decoding,
                queued=queued,
                batch_size=inst.decoding,
                kv_utilization=min(1.0, in_use / g1),
                prefill_tokens_per_s=spec.prefill_tokens_per_s,
                decode_tokens_per_s=1e3 / spec.decode_step_ms if spec.decode_step_ms else 1e3,
                links=self._links[inst.index],
                requested_state=None,
                ttl_ms=60_000,
            )
        return inst.status_record

    def scope(self, tenant: int) -> str:
        found = self.scopes.get(tenant)
        if found is None:
            found = self.scopes[tenant] = scope_id(tenant_scope_key(tenant)).hex()
        return found

    def resident_prefix(self, inst: SimInstance, blocks: list[BlockId]) -> int:
        store = inst.store
        for n, block in enumerate(blocks):
            if block not in store:
                return n
        return len(blocks)

    # -- running -------------------------------------------------------------------------------

    def _push(self, at_us: float, kind: int, data: Any) -> None:
        heapq.heappush(self._events, (at_us, next(self._seq), kind, data))

    def run(
        self,
        requests: Sequence[SimRequest],
        progress: Callable[[int], None] | None = None,
    ) -> list[RequestResult]:
        """Replay ``requests`` (in arrival order) to the end; one result per request."""
        for request in requests:
            self._push(request.arrival_ms * 1e3, _ARRIVE, request)
        handlers: dict[int, Callable[[Any], None]] = {
            _ARRIVE: self._arrive,
            _START: self._start,
            _FAIL: self._fail,
            _PREFILLED: self._prefilled,
            _DECODED: self._decoded,
        }
        events = self._events
        done = 0
        while events:
            at, _, kind, data = heapq.heappop(events)
            self.now_us = at
            self.clock.set(max(self.clock.now_ms(), int(at // 1000)))
            handlers[kind](data)
            if kind == _PREFILLED and progress is not None:
                done += 1
                if done % 500 == 0:
                    progress(done)
        if progress is not None:
            progress(done)
        return self.results

    def _apply(self, store: BlockStore) -> None:
        """The store's effects, to the index (as an instance's publisher sends them)."""
        effects: list[Effect] = store.take_effects()
        if not effects:
            return
        batch = []
        for effect in effects:
            if isinstance(effect, Publish):
                batch.append(effect.record)
                continue
            if batch:
                self.index.publish_many(batch)
                batch = []
            self.index.withdraw(effect.ref)
        if batch:
            self.index.publish_many(batch)

    def _arrive(self, request: SimRequest, failed_over: bool = False) -> None:
        scope = self.scope(request.tenant)
        compat = self.compat
        blocks = [(compat, scope, key) for key in request.keys]
        if not self.active():
            arrival = request.arrival_ms * 1e3
            self.results.append(
                RequestResult(arrival, math.inf, math.inf, request.prompt_tokens, 0, 0, 0, -1, True)
            )
            return
        choice = self.policy.choose(self, request, blocks)
        inst = choice.instance
        spec = self.scenario.instances
        admission = _Admission(request, blocks, inst, failed_over)
        fetch_us = 0.0
        if self.policy.infinite_cache:
            reused = next((n for n, b in enumerate(blocks) if b not in self.seen), len(blocks))
        else:
            local = self.resident_prefix(inst, blocks)
            reused = local
            if choice.usable_blocks is not None and choice.usable_blocks > local:
                reused = choice.usable_blocks
                admission.fetched_octets = choice.fetch_octets
                fetch_us = choice.fetch_us
                if spec.ingress_mbit_per_s:  # all sources share what the instance can receive
                    fetch_us = max(fetch_us, 8 * choice.fetch_octets / spec.ingress_mbit_per_s)
            admission.g2_octets = self._take(inst, admission, local, reused)
        admission.reused = reused
        load_us = 8 * admission.g2_octets / spec.host_read_mbit_per_s
        if spec.import_mbit_per_s and not self.policy.infinite_cache:
            load_us += 8 * reused * self.data_octets / spec.import_mbit_per_s
        reused_tokens = min(reused * self.scenario.model.block_tokens, request.prompt_tokens)
        new = request.prompt_tokens - reused_tokens
        compute_us = 1e6 * new / spec.prefill_tokens_per_s + 1e3 * spec.overhead_ms
        compute_us += 1e-3 * spec.attention_ns_per_pair * new * (reused_tokens + new / 2)
        now = self.now_us
        if choice.prefetch:
            start = max(inst.free_at, now + fetch_us)
            end = start + load_us + compute_us
        else:
            start = max(inst.free_at, now)
            end = start + fetch_us + load_us + compute_us
        inst.free_at = end
        heapq.heappush(inst.ends, end)
        inst.status_record = None
        admission.queue_us = start - now
        self._push(end, _PREFILLED, admission)
        if self.policy.hints:
            self._send(self.hint_table.turn_started(request.session, inst.url, self.clock.now_ms()))

    def _take(self, inst: SimInstance, admission: _Admission, local: int, reused: int) -> int:
        """Put the reused blocks in use at ``inst``: its own blocks first (G2 ones copied up to
        G1), then the fetched ones, each stored and used as it arrives (as the instance does);
        returns the octets read from G2."""
        store = inst.store
        blocks = admission.blocks
        inst.refs.acquire(blocks[:local])
        admission.acquired.extend(blocks[:local])
        g2 = 0
        for block in blocks[:local]:
            if "device" not in store.spans(block):
                g2 += self.data_octets
                with contextlib.suppress(CapacityExhausted):  # else read from G2 where it is
                    store.promote(block)
        for block in blocks[local:reused]:
            self._hold(inst, block, admission)
        self._apply(store)
        return g2

    def _hold(self, inst: SimInstance, block: BlockId, admission: _Admission) -> None:
        """Store a block at ``inst`` (unless held already) and use it for ``admission``."""
        try:
            inst.store.put(block, self.meta, self._data)
        except AlreadyStored:
            pass
        except CapacityExhausted:
            self.counters.uncached_blocks += 1  # everything is in use: used, not cached
            return
        inst.refs.acquire((block,))
        admission.acquired.append(block)

    def _offload(self, block: BlockId) -> None:
        """A computed block's copy at its standalone holder (as ``offload_url`` sends it)."""
        holder = self.holders[int(block[2][:8], 16) % len(self.holders)]
        if block not in holder.store:
            with contextlib.suppress(CapacityExhausted):
                holder.store.put(block, self.meta, self._data)
            self._apply(holder.store)

    def _prefilled(self, admission: _Admission) -> None:
        if admission.done:
            return  # its instance failed; the request was placed again
        inst, request, blocks = admission.instance, admission.request, admission.blocks
        if self.policy.infinite_cache:
            self.seen.update(blocks)
        else:
            for block in blocks[admission.reused :]:
                self._hold(inst, block, admission)
                if self.holders:
                    self._offload(block)
            self._apply(inst.store)
        spec = self.scenario.instances
        context = (request.prompt_tokens + request.output_tokens // 2) * (
            self.scenario.model.token_octets
        )
        inst.decoding += 1
        inst.batch_octets += context
        inst.status_record = None
        step_ms = spec.decode_step_ms + spec.decode_ms_per_gbyte * inst.batch_octets / 1e9
        admission.done = True
        admission.context = context
        self._push(self.now_us + 1e3 * step_ms * request.output_tokens, _DECODED, admission)
        bt = self.scenario.model.block_tokens
        arrival = request.arrival_ms * 1e3
        self.results.append(
            RequestResult(
                arrival,
                self.now_us - arrival,
                admission.queue_us,
                request.prompt_tokens,
                min(admission.reused * bt, request.prompt_tokens),
                admission.fetched_octets,
                admission.g2_octets,
                inst.index,
                admission.failed_over,
            )
        )

    def _decoded(self, admission: _Admission) -> None:
        inst, request = admission.instance, admission.request
        if not inst.alive:
            return
        inst.decoding -= 1
        inst.batch_octets -= admission.context
        inst.status_record = None
        if not self.policy.infinite_cache:
            inst.refs.release(admission.acquired)
        if self.policy.hints:
            now = self.clock.now_ms()
            if request.last:
                _, planned = self.hint_table.ended(request.session)
            else:
                planned = self.hint_table.turn_ended(
                    request.session, inst.url, now, request.tool_call
                )
            self._send(planned, admission.blocks)
        inst.pins.expire()

    def _send(self, planned: list[PlannedHint], blocks: list[BlockId] | None = None) -> None:
        """Carry out the controller's hints at their instances (``kv.share`` is not sent: the
        next instance fetches through the index anyway)."""
        for hint in planned:
            name = hint.action_type
            if name is ActionType.SHARE or blocks is None:
                continue
            inst = self.nodes[hint.instance]
            assert isinstance(inst, SimInstance)
            action = HintAction.model_construct(
                action_id=str(next(self._actions)),
                action_type=name,
                action_version="1.0",
                payload=hint.payload,
            )
            payload = parse_payload(action)
            if isinstance(payload, str):  # pragma: no cover - the controller's own payloads
                raise AssertionError(payload)
            outcome, held = inst.hints.prepare(action, payload, blocks)
            if held:
                kind = action_name(action)
                assert kind is not None
                outcome = inst.hints.run(
                    kind, outcome, held, payload, hint.payload["target"]["session"]
                )
            entry = self.hint_table.get(hint.payload["target"]["session"])
            if entry is not None:
                self.hint_table.outcome(entry, hint, outcome.to_json())
            label = f"{name}:{outcome.outcome}"
            self.counters.hints[label] = self.counters.hints.get(label, 0) + 1
            self._apply(inst.store)

    def _start(self, index: int) -> None:
        self.instances[index].alive = True

    def _fail(self, index: int) -> None:
        inst = self.instances[index]
        if not inst.alive:
            return
        inst.alive = False
        for block in inst.store.held():
            inst.store.drop(block)
        self._apply(inst.store)
        pending = [data for _, _, kind, data in self._events if kind == _PREFILLED]
        for admission in pending:
            if admission.instance is inst and not admission.done:
                admission.done = True
                self.counters.failovers += 1
                self._arrive(admission.request, failed_over=True)
