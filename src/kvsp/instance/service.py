"""The inference instance: the engine serving sessions, its KV cache speaking KVSP.

- **Paged pool.** Blocks live in the embedded holder's tiered store: ``device`` (G1, fixed KV
  pages, ``g1_blocks`` blocks, of which each keeps its first ``g1_layers`` layers there) before
  ``host`` (G2, ``g2_bytes``). The store evicts least recently used first, demotes G1 victims to
  G2 before dropping anything, withdraws every record before a drop, and reports per-layer
  residency in the records. Blocks that a running request uses are referenced (``BlockRefs``)
  and, like leased ones, never moved or dropped by pressure until it ends.
- **Reuse.** A request's prompt is cut into Block Keys with its tenant's scope key. The longest
  prefix held here is read from G1 and G2, then the rest of it from remote holders found through
  the Index Service (fetched with every digest verified, then held here too). Only the rest is
  computed; the last prompt token always is, for the logits of the first output token. The
  summary says how many tokens came from each tier.
- **Holder role.** Every completed block, of the prompt or of the output, is exported as a KVB1
  container into the pool (published, served, leasable) and, with ``offload_url``, copied to a
  standalone holder so that it survives this process.
- **Sessions (KVSP 6.8).** Output tokens carry their index and the session epoch. A checkpoint
  goes to the controller when a block of output completes and at least every 64 tokens; with a
  sampler that is not deterministic, tokens are released only up to the offset the controller has
  acknowledged, checkpointing every ``release_batch`` tokens to bound the delay. A resume loads
  the checkpoint's blocks, recomputes what they do not cover, restores the sampler's step and
  continues with the new epoch.
- **Prefetch (6.5)**: ``instance/prefetch.py``. **Status and lifecycle (6.3)**: ``_status_loop``.

The engine runs on one worker thread; the event loop only moves messages, so HTTP, status and
prefetch go on while a forward pass runs.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import replace
from typing import Any

from kvsp.auth import Principal, Role, authorize
from kvsp.core.clock import SystemClock
from kvsp.core.hints import HintOutcome, KvHints
from kvsp.core.ids import tenant_session
from kvsp.core.problems import (
    ConfigurationError,
    ContainerError,
    IllegalTransition,
    InstanceFailed,
    InvalidInput,
    KvspError,
    MethodNotAllowed,
    NotAccepting,
    NotFound,
    ServiceUnavailable,
    StaleEpoch,
)
from kvsp.core.records import (
    InstanceState,
    InstanceStatusRecord,
    PrefetchDirective,
    PrefetchStatus,
    ReshardAbort,
    ReshardCommit,
    ReshardPlan,
    Sampler,
    SessionCheckpoint,
    split_prompt,
)
from kvsp.core.registries import Tier
from kvsp.core.urls import canonical_url
from kvsp.holder.client import HolderClient
from kvsp.holder.service import HolderConfig, HolderService
from kvsp.holder.store import Protected, TierData
from kvsp.index.client import IndexClient
from kvsp.instance.config import InstanceConfig
from kvsp.instance.controller_client import ControllerClient
from kvsp.instance.engine import Engine, KvState
from kvsp.instance.engine_metrics import EngineCounters, EngineLoad, EngineMetrics
from kvsp.instance.events import EventPage
from kvsp.instance.fair import FairWorker
from kvsp.instance.generation import EngineRates, generate
from kvsp.instance.hints import PinTable
from kvsp.instance.kvpool import BlockRefs, KvPages
from kvsp.instance.links import LinkEstimates
from kvsp.instance.prefetch import Prefetcher
from kvsp.instance.release import ReleaseGate
from kvsp.instance.reuse import Reuse
from kvsp.instance.session_kv import SessionKv
from kvsp.instance.sessions import MOVED, Session, TokenEvent
from kvsp.instance.shards import HeldRange, ShardHoldings
from kvsp.kvevents.feed import KvEventFeed
from kvsp.kvevents.publisher import (
    KvEventPublisher,
    PublishedFeed,
    PublisherMetrics,
    epoch_seq,
)
from kvsp.model import SERVED_MODEL_NAME, ModelFiles, installed
from kvsp.tasks import Wakeup, cancel_all

__all__ = ["InstanceService"]

log = logging.getLogger("kvsp.instance")
_UNKNOWN = -1  # the id of a prompt token whose KV was imported from a block


#: who sends sessions named by the controller already (a client's names are namespaced here)
NAMED_BY_CONTROLLER = (Role.CONTROLLER, Role.FRONTEND)
#: how long a request to the controllers goes from one to the next (none leads for a moment
#: while a standby takes over: decision 0019), and how long a checkpoint is sent again
CONTROLLER_FAILOVER_S = 5.0
CHECKPOINT_RESEND_S = 60.0
#: how often the instance registers its descriptor at the IS again
REGISTER_EVERY_S = 60.0
#: whose turn the controller's own engine work (sequence shards) takes
CONTROL_TURN = ""


class InstanceService:
    #: whether the engine can hold sequence-sharded caches (KVSP 6.9): it needs the KV of any
    #: token range, which the reference engine has and vLLM's does not expose
    sharded_caches = True
    #: whether the engine keeps its own pages apart from the pool (vLLM's G1, reported by its
    #: KV events); the reference engine's G1 is the pool's device tier
    engine_pages = False

    def __init__(self, config: InstanceConfig, files: ModelFiles | None = None) -> None:
        self.config = config
        self.url = canonical_url(config.url)
        self.files = files or installed(config.model_home, config.block_tokens)
        self.block_tokens = self.files.descriptor.block_tokens
        self.compat_id = self.files.compat_id.hex()
        #: what a prompt may hold (the engine may allow a shorter context than the model)
        self.bounds = self.files.bounds
        self.epoch = int(time.time() * 1000)
        self.state = InstanceState.ACTIVE
        #: where the instance's own blocks go (None: whole blocks, G1 first)
        self.placement: list[tuple[Tier, tuple[int, int]]] | None = None
        device = self._start_engine()
        self.in_use = BlockRefs()
        tenants = len(list(config.tenants))
        pins = PinTable(SystemClock(), config.hint_limits, config.tenants.quotas, tenants)
        self.holder = HolderService(
            HolderConfig(
                url=config.url,
                host_bytes=config.g2_bytes,
                host_read_mbit_per_s=config.g2_read_mbit_per_s,
                index_url=config.index_url,
                index_token=config.token,
                quotas=config.tenants.quotas,
                record_ttl_ms=config.record_ttl_ms,
            ),
            device=device,
            in_use=Protected(self.in_use, pins),
        )
        self.peers = HolderClient(config.token)
        self.kv_events = self._start_kv_events()
        self.kv = SessionKv(
            self.holder,
            self.peers,
            self.in_use,
            pins,
            config.g1_layers,
            config.session_index,
            config.events,
            engine_g1=self.engine_pages,
            kv_events=self.kv_events,
        )
        if self.kv_events is not None:
            self.kv_events.flush()  # AllBlocksCleared: whatever an earlier process held is gone
        self.holder.observe = self.kv.observe
        #: wakes the readers of ``events_after`` (events come from the loop and the store's
        #: thread)
        self._news = Wakeup()
        self.kv.events.on_append = self._news.fire
        self.index = (
            None if config.index_url is None else IndexClient(config.index_url, config.token)
        )
        self.controller = (
            None
            if config.controller_url is None
            else ControllerClient(
                config.controller_url.split(","), config.token, failover_s=CONTROLLER_FAILOVER_S
            )
        )
        #: measured transfer rate (Mbit/s) and round trip (us) per holder fetched from
        self.links = LinkEstimates()
        self.reuse = Reuse(
            self.url,
            self.compat_id,
            self.block_tokens,
            self.holder,
            self.peers,
            self.index,
            self.kv,
            self.in_use,
            self.links,
            self.placement,
            config.offload_url,
        )
        self.sessions: OrderedDict[str, Session] = OrderedDict()
        self.prefetcher = Prefetcher(
            self.holder, self.peers, self.index, self.reuse.fetch, self.placement
        )
        self.shards = ShardHoldings()
        self.rates = EngineRates()
        #: the engine's one thread, shared fairly between tenants
        self.engine_thread = FairWorker("kvsp-engine")
        self.counters = EngineCounters()
        self.holder.registry.register(
            EngineMetrics(self.counters, self.engine_now, SERVED_MODEL_NAME)
        )
        self._idle_since = time.monotonic()
        self._tasks: set[asyncio.Task[None]] = set()

    def _start_engine(self) -> tuple[int, TierData] | None:
        """Load the engine; its KV pages become the store's G1 tier (``device``), each block
        keeping its first ``g1_layers`` layers there and the rest in G2."""
        config, g = self.config, self.files.descriptor.geometry
        self.engine = Engine(self.files, config.threads)
        g1_layers = g.layers if config.g1_layers is None else config.g1_layers
        if not 1 <= g1_layers <= g.layers:
            raise ConfigurationError(f"g1_layers must be 1 to {g.layers}")
        self.pages = KvPages(config.g1_blocks, g1_layers, 2 * g.section_bytes(config.block_tokens))
        if g1_layers != g.layers:
            self.placement = [("device", (0, g1_layers - 1)), ("host", (g1_layers, g.layers - 1))]
        return self.pages.capacity, self.pages

    def _start_kv_events(self) -> PublishedFeed | None:
        settings = self.config.kv_events
        if settings is None:
            return None
        publisher = KvEventPublisher(replace(settings, first_seq=epoch_seq(self.epoch)))
        self.holder.registry.register(PublisherMetrics(publisher, "kvsp_instance_kv_events"))
        return PublishedFeed(KvEventFeed(self.block_tokens), publisher)

    def kv_events_endpoints(self) -> dict[str, str | None] | None:
        """Where the KV events are published and replayed (what an indexer registers)."""
        if self.kv_events is None:
            return None
        p = self.kv_events.publisher
        return {"endpoint": p.endpoint, "replay_endpoint": p.replay_endpoint, "topic": p.topic}

    def kv_utilization(self) -> float:
        """The share of the engine's KV pages in use."""
        return 1 - self.pages.free_pages * self.pages.page_octets / self.pages.capacity

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        await self.holder.start()
        self._spawn(self._status_loop())
        if self.index is not None:
            self._spawn(self._register(self.index))

    async def _register(self, index: IndexClient) -> None:
        """Tell the IS what this instance's Compatibility ID stands for (KVSP 4.1), so it can
        answer lookups as 6.2 writes them with estimates; again every minute (an IS on the
        memory store forgets over a restart), a second after a failure."""
        while True:
            try:
                await index.register(self.files.descriptor)
                await asyncio.sleep(REGISTER_EVERY_S)
            except KvspError as exc:
                log.warning("descriptor not registered at the index: %s", exc.detail)
                await asyncio.sleep(1.0)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``work`` in the background; finished tasks let go of themselves."""
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        await cancel_all(list(self._tasks))
        await self.peers.aclose()
        for client in (self.index, self.controller):
            if client is not None:
                await client.aclose()
        await self.holder.close()
        if self.kv_events is not None:
            self.kv_events.publisher.close()
        self.engine_thread.shutdown()

    async def readiness(self) -> list[str]:
        """Why this instance should get no traffic now (``readyz``): it drains or sleeps, or
        its holder is not serving. Its model is loaded before its port opens (the service
        builds the engine), so a startup probe on ``livez`` covers the load."""
        reasons = await self.holder.readiness()
        if self.state is not InstanceState.ACTIVE:
            reasons.append(f"the instance is {self.state.value}")
        return reasons

    def engine_now(self) -> EngineLoad:
        """The engine's queue and pages now (the ``vllm:`` gauges)."""
        queued, batch = self.engine_load()
        return EngineLoad(queued, batch, self.kv_utilization())

    def running(self) -> int:
        return sum(1 for s in self.sessions.values() if not s.done)

    def engine_load(self) -> tuple[int, int]:
        """Sessions waiting for the engine (``queued``: admitted, no step taken yet) and the
        sessions it is advancing together (``batch_size``: their steps interleave on the
        engine thread, each at a share of its rate)."""
        live = [s for s in self.sessions.values() if not s.done]
        begun = sum(s.begun for s in live)
        return len(live) - begun, begun

    @functools.cached_property
    def engine_identity(self) -> str:
        """What decides this instance's output bits (``Engine.identity``)."""
        return self.engine.identity

    def status(self) -> InstanceStatusRecord:
        queued, batch = self.engine_load()
        links = [
            {"holder": holder, "mbit_per_s": rate, "rtt_us": rtt}
            for holder, rate, rtt in self.links
        ]
        return InstanceStatusRecord.model_validate(
            {
                "instance": self.url,
                "epoch": self.epoch,
                "state": self.state,
                "running": self.running(),
                "queued": queued,
                "batch_size": batch,
                "kv_utilization": self.kv_utilization(),
                "prefill_tokens_per_s": self.rates.prefill,
                "decode_tokens_per_s": self.rates.decode,
                "links": links,
                "ttl_ms": self.config.status_ttl_ms,
                "requested_state": InstanceState.SLEEPING if self._wants_sleep() else None,
                "engine": self.engine_identity,
                "g2_utilization": self.g2_utilization(),
            }
        )

    def g2_utilization(self) -> float:
        """The share of the holder's host tier (G2) in use."""
        capacity = self.holder.capacities.get("host", 0)
        return min(1.0, self.holder.store.used().get("host", 0) / capacity) if capacity else 0.0

    def _wants_sleep(self) -> bool:
        """Idle for ``sleep_after_s`` (KVSP 6.3: an instance MAY ask to sleep)."""
        if self.running():
            self._idle_since = time.monotonic()
            return False
        limit = self.config.sleep_after_s
        idle = time.monotonic() - self._idle_since
        return self.state is InstanceState.ACTIVE and limit is not None and idle >= limit

    async def _status_loop(self) -> None:
        period = self.config.status_ttl_ms / 3000
        while True:
            if self.state is InstanceState.DRAINING and self.running() == 0:
                self.state = InstanceState.SLEEPING
            if self.controller is not None:
                try:
                    answer = await self.controller.put_status(self.status())
                    if answer is InstanceState.DRAINING and self.state is InstanceState.ACTIVE:
                        self.state = InstanceState.DRAINING
                except InstanceFailed as exc:
                    log.warning("%s", exc.detail)
                    self._rejoin()
                    continue  # report the new epoch at once
                except KvspError as exc:
                    log.warning("status not delivered: %s", exc.detail)
            await asyncio.sleep(period)

    def _rejoin(self) -> None:
        """The controller marked this epoch failed and failed its sessions over: take a new
        epoch (the clock in ms, above the old one: KVSP 6.3's rule holds) and stop every
        session of the old one. Their streams end saying the session moved, so the front end
        follows it to the instance that resumed it."""
        self.epoch = max(int(time.time() * 1000), self.epoch + 1)
        for session in self.sessions.values():
            if not session.done:
                session.cancel(MOVED)
        log.warning("rejoining with epoch %d", self.epoch)

    def set_state(self, principal: Principal, state: InstanceState) -> InstanceState:
        authorize(principal, Role.CONTROLLER)
        if state is InstanceState.ACTIVE:
            self.state = state
            self._idle_since = time.monotonic()  # a fresh start before asking to sleep again
        elif state is InstanceState.DRAINING:
            self.state = state if self.running() else InstanceState.SLEEPING
        else:
            raise IllegalTransition("the controller can make an instance active or draining")
        return self.state

    # -- generation ----------------------------------------------------------------------------

    def _admit(self, session: Session) -> None:
        self.sessions.pop(session.session, None)
        self.sessions[session.session] = session
        finished = [k for k, s in self.sessions.items() if s.done]
        for key in finished[: max(0, len(self.sessions) - self.config.max_sessions)]:
            del self.sessions[key]

    def _gate(self, sampler: Sampler, offset: int) -> ReleaseGate:
        """The release gate of a session with ``sampler``, resumed at ``offset`` (0: new)."""
        checkpoints = self.controller is not None
        return ReleaseGate.resumed(
            checkpoints and not sampler.deterministic,
            checkpoints,
            offset,
            release_batch=self.config.release_batch,
            checkpoint_every=self.config.checkpoint_every,
        )

    def _check_accepting(self) -> None:
        """A draining or sleeping instance takes no new session, resumed or not (KVSP 6.3)."""
        if self.state is not InstanceState.ACTIVE:
            raise NotAccepting(f"instance is {self.state}; it accepts no new sessions")

    async def generate(
        self,
        principal: Principal,
        tenant_name: str,
        tokens: Sequence[int],
        sampler: Sampler,
        max_tokens: int | None,
        session_id: str | None = None,
        epoch: int = 0,
        kv_hints: KvHints | None = None,
    ) -> Session:
        """Start generating for a prompt; read the tokens with ``stream``. ``kv_hints`` (from
        the controller only) are executed once the request is done."""
        authorize(principal, (Role.CONTROLLER, Role.FRONTEND, Role.CLIENT))
        if kv_hints is not None:
            authorize(principal, Role.CONTROLLER)
        tenant = self.config.tenants.for_principal(principal, tenant_name)
        if session_id is not None and not principal.has_any_role(NAMED_BY_CONTROLLER):
            # a client's own name for a session, in its tenant's namespace
            session_id = tenant_session(tenant.scope_id, session_id)
        self._check_accepting()
        if not tokens:
            raise InvalidInput("a prompt needs at least one token")
        cap = min(max_tokens or self.config.max_tokens, self.config.max_tokens)
        self.bounds.check(tokens, cap)
        b = self.block_tokens
        cut, tail, last_block = split_prompt(tokens, b)
        all_keys = [k.hex() for k in tenant.chain(self.compat_id, b).extend(tokens)]
        prompt_blocks = tuple(all_keys[:cut])
        chain = tenant.chain_after(self.compat_id, b, prompt_blocks)
        chain.extend(list(tail))
        session = Session(
            session_id or str(uuid.uuid4()),
            tenant,
            epoch,
            sampler,
            cap,
            prompt_blocks,
            tail,
            last_block,
            chain,
            self._gate(sampler, 0),
            hints=None if kv_hints is None else (principal, kv_hints),
            prompt_tokens=tuple(tokens[: cut * b]),
        )
        await self._begin(session, tokens)
        return session

    async def _begin(self, session: Session, tokens: Sequence[int]) -> None:
        """Load the longest prefix held anywhere, then compute the rest in the background."""
        b = self.block_tokens
        prefix = self.engine.prefix(len(tokens))
        try:  # the last prompt token is computed: the first output token needs its logits
            keys = session.prompt_blocks[: (len(tokens) - 1) // b]
            state = prefix.state(tokens[: await self.reuse.load(session, keys, prefix.add) * b])
        except BaseException:
            await self.reuse.release(session)
            raise
        self._admit(session)
        self.counters.prompt(len(tokens), session.cached)
        rest = list(tokens[len(state) :])
        self._spawn(self._run(session, state, rest, 0))

    async def resume(
        self, principal: Principal, checkpoint: SessionCheckpoint, max_tokens: int | None
    ) -> Session:
        """Continue a session another instance served, from its latest checkpoint (6.8)."""
        authorize(principal, Role.CONTROLLER)
        tenant = self.config.tenants.by_scope(checkpoint.scope_id)
        if tenant is None:
            raise NotFound(f"no tenant has scope {checkpoint.scope_id}")
        self._check_accepting()
        b = self.block_tokens
        start, known = checkpoint.resume_input(b)
        chain = tenant.chain_after(self.compat_id, b, checkpoint.prompt_blocks)
        chain.extend(list(checkpoint.prompt_tail + checkpoint.generated))
        session = Session(
            checkpoint.session,
            tenant,
            checkpoint.epoch,
            checkpoint.sampler,
            min(max_tokens or self.config.max_tokens, self.config.max_tokens),
            checkpoint.prompt_blocks,
            checkpoint.prompt_tail,
            checkpoint.last_block,
            chain,
            self._gate(checkpoint.sampler, checkpoint.output_offset),
            generated=list(checkpoint.generated),
        )
        await self._begin_resume(session, start, known)
        return session

    async def _begin_resume(self, session: Session, start: int, known: Sequence[int]) -> None:
        """Load the checkpoint's first ``start`` prompt blocks (and later ones held
        anywhere), recompute the rest (``known``: the tokens after those blocks) and continue."""
        b = self.block_tokens
        # every block key whose tokens are all known, except the block holding the last token
        keys = session.keys()
        covered_max = (start * b + len(known) - 1) // b
        ids = [_UNKNOWN] * (start * b) + list(known)
        prefix = self.engine.prefix(len(ids))
        try:
            loaded = await self.reuse.load(session, keys[:covered_max], prefix.add)
            if loaded < start:
                raise NotFound("the checkpoint's prompt blocks are not held anywhere reachable")
        except BaseException:
            await self.reuse.release(session)
            raise
        state = prefix.state(ids[: loaded * b])
        self._admit(session)
        rest = ids[len(state) :]
        session.max_tokens = max(session.max_tokens, len(session.generated))
        self._spawn(self._run(session, state, rest, len(session.generated)))

    async def _run(
        self, session: Session, state: KvState, rest: list[int], first_step: int
    ) -> None:
        """Generate on the engine thread (``instance/generation.py``), then finish."""
        try:
            await generate(
                self.engine,
                self.engine_thread,
                session,
                state,
                rest,
                first_step,
                self.config.prefill_chunk,
                self.rates,
                self._on_block,
                self._on_token,
            )
        except Exception as exc:  # the session ends with the error; the service goes on
            log.exception("session %s failed", session.session)
            session.error = repr(exc)
        await self._finish(session)

    async def _finish(self, session: Session) -> None:
        """The request is over: its blocks stored, released, its hints run, a last checkpoint."""
        await asyncio.sleep(0)  # let the last events land
        await asyncio.gather(*session.stores, return_exceptions=True)
        await self.reuse.release(session)
        if session.hints is not None:
            session.hint_outcomes = await self.kv.execute(
                session.hints[0], self.compat_id, session.hints[1]
            )
        if session.cancelled != MOVED:  # a moved session's epoch is over at the controller
            await self._checkpoint(session, last=True)
        # done only once the last checkpoint released what it covers: a reader woken meanwhile
        # (by another checkpoint's answer) must not take the session for over and stop short
        self.counters.finish(len(session.generated), session.cancelled is not None)
        session.done = True
        session.notify()

    def _on_block(self, session: Session, index: int, body: bytes) -> None:
        """Block ``index`` of the session is complete: indexed, stored, checkpointed."""
        block = session.block_of(self.compat_id, index)
        if block is not None:
            parent = session.block_of(self.compat_id, index - 1) if index else None
            tokens = session.tokens_of(index, self.block_tokens)
            self.kv.completed(session.session, block, parent, tokens)
        task = self._spawn(self.reuse.store(session, index, body))
        session.stores.add(task)
        task.add_done_callback(session.stores.discard)
        if session.gate.on_block():
            self._spawn(self._checkpoint(session))

    def _on_token(self, session: Session, token: int) -> None:
        """The session's next output token: released now, or once a checkpoint covers it."""
        if session.add_token(token):
            self._spawn(self._checkpoint(session))
        session.notify()

    async def _checkpoint(self, session: Session, last: bool = False) -> None:
        """Send the session's checkpoint; the gate releases what the answer acknowledges.
        While no controller can take it (none leads for a moment, or its state store is
        away), the latest checkpoint is sent again until one does, for at most
        ``CHECKPOINT_RESEND_S``: tokens waiting for an acknowledgement are never dropped.
        One sender at a time; the ``last`` one (the session is over) waits its turn."""
        if self.controller is None or (session.checkpointing.locked() and not last):
            return  # the sender already at work sends the latest
        async with session.checkpointing:
            while await self._send_checkpoint(session):
                pass  # more came while one was in flight, and it waits for an acknowledgement

    async def _send_checkpoint(self, session: Session) -> bool:
        """One checkpoint, sent until taken; whether tokens came meanwhile that wait."""
        assert self.controller is not None  # checked by the caller
        pause, deadline = 0.05, time.monotonic() + CHECKPOINT_RESEND_S
        while True:
            try:
                checkpoint = session.checkpoint(self.compat_id)
                acknowledged = await self.controller.checkpoint(checkpoint)
                break
            except ServiceUnavailable as exc:
                if session.cancelled == MOVED or time.monotonic() >= deadline:
                    log.warning("checkpoint of %s: %s", session.session, exc.detail)
                    return False
            except StaleEpoch as exc:
                # the controller failed the session over: it goes on elsewhere, and its stream
                # here ends saying so, as after ``_rejoin`` (whose status answer may come
                # later, or never reach a session that is finishing)
                log.warning("checkpoint of %s: %s; it moved", session.session, exc.detail)
                session.cancel(MOVED)
                return False
            except KvspError as exc:
                log.warning("checkpoint of %s: %s", session.session, exc.detail)
                return False
            await asyncio.sleep(pause)
            pause = min(2 * pause, 0.5)
        session.gate.on_ack(acknowledged)
        session.notify()
        return checkpoint.output_offset < len(session.generated) and session.gate.gated

    def stream(
        self, session_id: str, start: int, principal: Principal
    ) -> AsyncIterator[TokenEvent | dict[str, Any]]:
        """Released tokens from index ``start`` as they come, then a summary; ``NotFound``
        at once (before any answer starts) for a session not here, or not in a scope of
        ``principal`` (the same answer: a session's existence is its tenant's business)."""
        session = self.sessions.get(session_id)
        if session is None or not principal.may_access_scope(session.tenant.scope_id):
            raise NotFound(f"no session {session_id} here")
        return self._released(session, start)

    async def _released(
        self, session: Session, start: int
    ) -> AsyncIterator[TokenEvent | dict[str, Any]]:
        index = start
        while True:
            changed = session.changed
            while index < session.released:
                yield TokenEvent(index, session.epoch, session.generated[index])
                index += 1
            if session.done and index >= session.released:
                yield session.summary()
                return
            await changed.wait()

    # -- session-aware KV (hints, events) -------------------------------------------------------

    async def hints(self, principal: Principal, hints: KvHints) -> list[HintOutcome]:
        """Every action of the envelope, answered with its outcome (never a problem for an
        action: only for a caller who may not send hints at all)."""
        authorize(principal, Role.CONTROLLER)
        return await self.kv.execute(principal, self.compat_id, hints)

    async def end_session(self, principal: Principal, session: str) -> int:
        """The controller says a session is over (or its client went away): generation
        stops, it owns nothing and its pins go."""
        authorize(principal, Role.CONTROLLER)
        running = self.sessions.get(session)
        if running is not None and not running.done:
            running.cancel("ended by the controller")
        return await self.holder.call(lambda: self.kv.end(session))

    async def events_after(self, after: int, limit: int, wait_ms: int) -> EventPage:
        """Events after ``after``; with none yet, wait up to ``wait_ms`` for the next ones
        (woken by the next event, not polling)."""
        deadline = time.monotonic() + wait_ms / 1000
        while True:
            with self._news.waiting() as wait:
                page = self.kv.events.after(after, limit)
                left = deadline - time.monotonic()
                if page.events or page.missed or left <= 0:
                    return page
                await wait(left)

    # -- prefetch (6.5) ------------------------------------------------------------------------

    async def prefetch(self, principal: Principal, directive: PrefetchDirective) -> None:
        authorize(principal, Role.CONTROLLER)
        if self.state is not InstanceState.ACTIVE:
            raise ServiceUnavailable("prefetch goes to active instances only")
        if self.prefetcher.accept(directive):
            self._spawn(self.prefetcher.run(directive))

    def prefetch_status(self, directive: str) -> PrefetchStatus:
        return self.prefetcher.status(directive)

    # -- sequence-sharded caches (6.9) ---------------------------------------------------------

    def _check_shards(self) -> None:
        if not self.sharded_caches:
            raise MethodNotAllowed("this instance's engine does not hold sequence-sharded caches")

    async def load_shard(
        self,
        principal: Principal,
        map_id: str,
        version: int,
        tokens: Sequence[int],
        ranges: Sequence[tuple[int, int]],
    ) -> None:
        """Compute the KV of a context and hold the given token ranges of it, at ``version``."""
        authorize(principal, Role.CONTROLLER)
        self._check_shards()
        if any(not 0 <= a < b <= len(tokens) for a, b in ranges):
            raise NotFound("a range lies outside the context")

        def work() -> list[HeldRange]:
            state = KvState()
            self.engine.forward(state, list(tokens))
            return [HeldRange((a, b), self.engine.export_range(state, a, b)) for a, b in ranges]

        held = await self.engine_thread.run(CONTROL_TURN, work)
        self.shards.load(map_id, version, held)

    async def reshard(self, principal: Principal, message: dict[str, Any]) -> None:
        """A plan (answered once every fetch range is loaded and verified), a commit, or an
        abort."""
        authorize(principal, Role.CONTROLLER)
        self._check_shards()
        if "commit" in message:
            commit = ReshardCommit.parse(message)
            self.shards.commit(commit.map, commit.commit)
            return
        if "abort" in message:
            abort = ReshardAbort.parse(message)
            self.shards.abort(abort.map, abort.abort)
            return
        plan = ReshardPlan.parse(message)
        self.shards.begin(plan)
        g = self.engine.geometry
        for move in plan.fetch:
            start, end = move.tokens
            path = f"shards/{plan.map}/kv?tokens={start}-{end}"
            limit = 64 + 32 * g.layers + 2 * g.layers * g.section_bytes(end - start)
            kv = await self.peers.get_container(move.from_, path, limit)
            if kv.header.token_count != end - start or kv.header.layer_count != g.layers:
                raise ContainerError(
                    f"{move.from_} sent a container that is not tokens {start}-{end}"
                )
            self.shards.fetched(plan.map, HeldRange((start, end), kv))
