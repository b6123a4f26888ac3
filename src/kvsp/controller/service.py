"""The Placement Controller's operations over its pure state: the Index Service is asked,
instances are told, and a tick turns expired statuses into failovers and late reshards into
aborts.

State lives in ``InstanceTable``, ``SessionTable`` and ``ReshardCoordinator``; this module only
sequences them with the network. Every refusal happens before state changes (the tables check
first); a peer that cannot be reached is logged and counted, never left half-applied in the
tables: a session moves to a new instance only once that instance has accepted the resume.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvsp.auth import Principal, Role, authorize
from kvsp.controller.client import InstanceClient
from kvsp.controller.forwarding import StatusForwarder
from kvsp.controller.hint_sender import HintSender
from kvsp.controller.hints import (
    HintPolicy,
    PinOrDemote,
    PlannedHint,
    SessionHints,
    SessionHintTable,
)
from kvsp.controller.instances import InstancePolicy, InstanceTable
from kvsp.controller.leadership import Leadership
from kvsp.controller.metrics import ControllerMetrics
from kvsp.controller.overlap import prefix_report
from kvsp.controller.overview import PlacementLog
from kvsp.controller.placement import (
    Decision,
    Outcome,
    PlacementPolicy,
    PlacementRequest,
    build_directive,
    place,
)
from kvsp.controller.reshard import ReshardCoordinator, ReshardResult, propose
from kvsp.controller.sessions import (
    CheckpointAnswer,
    Session,
    SessionTable,
    resumers,
    sampler_for,
)
from kvsp.controller.stores import (
    Change,
    ControlStore,
    DropDecision,
    DropSession,
    PutDecision,
    PutHints,
    PutInstance,
    PutMap,
    PutPending,
    PutReshard,
    PutSession,
    open_control_store,
)
from kvsp.core.clock import Clock, SystemClock
from kvsp.core.ids import tenant_session
from kvsp.core.problems import InvalidInput, KvspError, NotFound, NotLeader, RecordError
from kvsp.core.records import (
    InstanceState,
    InstanceStatusRecord,
    LookupRequest,
    LookupResponse,
    PrefetchState,
    ReshardAbort,
    ReshardCommit,
    Sampler,
    SessionCheckpoint,
    ShardMap,
    split_prompt,
)
from kvsp.core.shared import ScopedChain
from kvsp.core.urls import canonical_url
from kvsp.index.client import IndexClient
from kvsp.tasks import Background, KeyedLocks, cancel_all
from kvsp.tenants import Tenant, Tenants
from kvsp.web import tracing

__all__ = ["ControllerConfig", "ControllerService", "Launcher", "Placement"]

log = logging.getLogger("kvsp.controller")

#: Roles that may ask for placements and report their TTFT.
OPERATOR_ROLES = (Role.CONTROLLER, Role.FRONTEND, Role.CLIENT)
#: Decisions whose measured TTFT may still be reported.
MAX_PREDICTIONS = 65_536
#: sessions the cluster page lists (the latest used)
UI_SESSIONS = 50


#: Block Keys derived on the event loop at most (about 2 us each); more go to a thread
KEYS_ON_LOOP = 64


async def _block_keys(
    chain: ScopedChain, tokens: Sequence[int], block_tokens: int
) -> tuple[str, ...]:
    """The prompt's Block Keys in hex; a long prompt's off the event loop."""

    def derive() -> tuple[str, ...]:
        return tuple(k.hex() for k in chain.extend(list(tokens)))

    if len(tokens) <= KEYS_ON_LOOP * block_tokens:
        return derive()
    return await asyncio.to_thread(derive)


class Launcher(Protocol):
    async def launch(self) -> str | None:
        """Start an instance; returns its base URL (it reports its status once up)."""
        ...


@dataclass(frozen=True)
class ControllerConfig:
    tenants: Tenants
    index_url: str | None = None
    index_token: str | None = None
    #: the token the controller presents to instances
    instance_token: str | None = None
    block_tokens: int = 16
    placement: PlacementPolicy = field(default_factory=PlacementPolicy)
    instances: InstancePolicy = field(default_factory=InstancePolicy)
    max_sessions: int = 1_000_000
    tick_s: float = 0.2
    #: what to tell instances as sessions go on (KvHints); None: no hints
    hints: HintPolicy | None = field(default_factory=PinOrDemote)
    #: where the state lives: ``memory`` (this process, which always leads) or a Redis URL
    #: shared by several controllers, one of which leads at a time (decision 0019)
    state: str = "memory"
    #: this controller's own base URL, which standbys name as the leader's
    url: str = ""
    #: how long a leader's lease lasts unless renewed (renewed every fifth of it)
    lease_ms: int = 1_500


@dataclass(frozen=True)
class Placement:
    decision: Decision
    block_keys: tuple[str, ...]
    #: names the decision when its measured TTFT is reported back
    decision_id: str = ""
    #: the directive sent to the chosen instance, its state, and the keys it loaded
    directive: str | None = None
    prefetch_state: str | None = None
    loaded: tuple[str, ...] = ()
    session_epoch: int | None = None
    #: the session's UUID (the tenant's name for it, namespaced: ``tenant_session``)
    session: str | None = None
    #: the sampler to serve the session with (``deterministic`` cleared unless every instance
    #: that could resume it computes the same bits: ``sessions.sampler_for``)
    sampler: Sampler | None = None

    def to_json(self) -> dict[str, Any]:
        doc = self.decision.to_json()
        doc["decision"] = self.decision_id
        doc["block_keys"] = len(self.block_keys)
        if self.directive is not None:
            doc["prefetch"] = {
                "directive": self.directive,
                "state": self.prefetch_state,
                "loaded": len(self.loaded),
            }
        if self.session_epoch is not None:
            doc["session_epoch"] = self.session_epoch
        if self.session is not None:
            doc["session"] = self.session
        if self.sampler is not None:
            doc["sampler"] = self.sampler.to_json()
        return doc


class ControllerService:
    def __init__(
        self,
        config: ControllerConfig,
        clock: Clock | None = None,
        index: IndexClient | None = None,
        instances: InstanceClient | None = None,
        launcher: Launcher | None = None,
        store: ControlStore | None = None,
    ) -> None:
        """``index``, ``instances`` and ``store`` replace those built from the config (tests)."""
        self.config = config
        self.clock = clock or SystemClock()
        self.instances = InstanceTable(self.clock, config.instances)
        self.sessions = SessionTable(config.max_sessions)
        self.reshards = ReshardCoordinator(self.clock)
        if index is None and config.index_url is not None:
            index = IndexClient(config.index_url, config.index_token)
        self.index = index
        self.peers = instances or InstanceClient(config.instance_token)
        self.forwarder = None if index is None else StatusForwarder(index.put_status)
        self.launcher = launcher
        #: the last placement costs per instance, for ``GET instances``
        self.last_costs: dict[str, dict[str, Any]] = {}
        #: the last placements and per-tenant reuse, for the cluster page (``GET ui/state``)
        self.placement_log = PlacementLog()
        self._tasks: list[asyncio.Task[None]] = []
        #: work beside the request that caused it (hints, session ends at instances)
        self._later = Background(log)
        self.metrics = ControllerMetrics()
        #: the hint policy's per-session state, and what sends its hints (None: no policy)
        self.hints = (
            None
            if config.hints is None
            else HintSender(
                self.peers,
                SessionHintTable(config.hints, config.max_sessions),
                self.metrics.hint_outcomes,
            )
        )
        #: predicted cost of recent decisions, until their measured TTFT arrives
        self._predictions: OrderedDict[str, float] = OrderedDict()
        self.store = store or open_control_store(config.state)
        self.lead = Leadership(
            self.store, config.url, config.lease_ms, self._elected, self._deposed
        )
        #: one operation at a time per session, across its awaits (check, write, apply)
        self._session_locks = KeyedLocks()

    # -- running -------------------------------------------------------------------------------

    async def start(self) -> None:
        with contextlib.suppress(KvspError):  # a standby, or Redis not there yet: run() retries
            await self.lead.step()
        self._tasks = [
            asyncio.create_task(self._ticker(), name="kvsp-controller-tick"),
            asyncio.create_task(self.lead.run(), name="kvsp-controller-lease"),
        ]
        if self.forwarder is not None:
            forwarding = asyncio.create_task(self.forwarder.run(), name="kvsp-status-forwarder")
            self._tasks.append(forwarding)

    async def close(self) -> None:
        await cancel_all(self._tasks)
        await self._later.cancel()
        await self.lead.close()
        await self.store.close()
        await self.peers.aclose()
        if self.index is not None:
            await self.index.aclose()

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            try:
                await self.tick()
            except Exception:  # a tick must never stop the controller
                log.exception("controller tick failed")

    async def tick(self) -> None:
        """Fail over the sessions of instances whose status expired; abort late reshards
        (the leader only)."""
        if not self.lead.leading():
            return
        for result in self.reshards.expire():
            await self._finish_reshard(result)
        await self._fail_over_all(await self._take_failures())

    async def _take_failures(self, *also: Change) -> list[tuple[str, list[tuple[str, int]]]]:
        """Instances failed (expired, or restarted with a higher epoch) since the last call,
        each with the open turns it served then and their epochs: taken in one step, so a
        session placed on the restarted instance afterwards is never moved away. The
        failures and their sessions, marked pending, are written in one write with ``also``
        before any session moves: a leader that dies before the moves are over leaves them
        to the next one (``_elected``)."""
        taken: list[tuple[str, list[tuple[str, int]]]] = []
        changes = list(also)
        for instance in self.instances.expire():
            log.warning("instance %s failed (status expired, or restarted)", instance.url)
            orphans = self.sessions.orphan(instance.url)
            taken.append((instance.url, [(s.session, s.epoch) for s in orphans]))
            changes.append(PutInstance(instance))
            changes.extend(PutPending(s) for s in orphans)
        await self._write(*changes)
        return taken

    # -- leading -------------------------------------------------------------------------------

    async def _write(self, *changes: Change) -> None:
        """Write changes the tables made through to the store; a controller that cannot (its
        token fenced out, or the store gone) stops leading, and the next leader loads what
        the store has, so the tables never answer for what the store lacks."""
        if not changes:
            return
        token = self.lead.check()
        try:
            await self.store.write(token, changes)
        except KvspError as exc:
            self.lead.depose(exc.detail)
            raise

    async def _elected(self, token: int) -> None:
        """This controller took the lease: fence the older leader out, then load."""
        await self.store.fence(token, [t.scope_id for t in self.config.tenants])
        snapshot = await self.store.load()
        self.instances.restore(snapshot.instances)
        self.sessions.restore(snapshot.sessions)
        if self.hints is not None:
            self.hints.table.restore(snapshot.hints)
        self.reshards.restore(snapshot.maps)
        self._predictions = OrderedDict(snapshot.decisions)
        failing_over = self.sessions.pending()
        log.warning(
            "loaded %d instances, %d sessions (%d failing over), %d shard maps",
            len(snapshot.instances), len(snapshot.sessions), len(failing_over), len(snapshot.maps),
        )  # fmt: skip
        # the old leader's unfinished failovers move on from where the store has them (a move
        # it made may not have reached its instance)
        for entry in failing_over:
            work = self._fail_over(entry.session, entry.instance, entry.epoch)
            self._later.run(work, f"failover of session {entry.session}")
        for pending in snapshot.reshards:  # begun by the old leader: finished, or aborted
            result = ReshardResult(
                pending["map"], pending["version"], bool(pending["commit"]),
                tuple(pending["members"]), "the controller that began it stopped leading",
            )  # fmt: skip
            self._later.run(self._announce_reshard(result), f"reshard of {result.map}")

    def _deposed(self) -> None:
        """Lost the lease: nothing of the old view may answer anyone."""
        self.instances.restore([])
        self.sessions.restore([])
        if self.hints is not None:
            self.hints.table.restore([])
        self.reshards.restore([])
        self._predictions.clear()

    async def _fail_over_all(self, failures: list[tuple[str, list[tuple[str, int]]]]) -> None:
        for url, sessions in failures:
            for result in self.reshards.member_failed(url):
                await self._finish_reshard(result)
            for session, epoch in sessions:
                await self._fail_over(session, url, epoch)

    # -- statuses and lifecycle ----------------------------------------------------------------

    async def put_status(self, principal: Principal, status: InstanceStatusRecord) -> InstanceState:
        """Take an instance's status and answer at once: the IS hears of it in the background
        (``StatusForwarder``), and the sessions of an epoch it replaces fail over in the
        background too."""
        authorize(principal, Role.INSTANCE, holder=status.instance)
        self.lead.check()
        state = self.instances.put_status(status)
        failures = await self._take_failures(PutInstance(self.instances.get(status.instance)))
        if failures:
            self._later.run(self._fail_over_all(failures), "failover after a restart")
        if self.forwarder is not None:
            self.forwarder.offer(status)  # estimates at the IS use it too
        return state

    async def set_state(self, principal: Principal, url: str, state: InstanceState) -> None:
        """Wake or drain ``url``: the table checks the move, the instance is told, and only
        then does the table make it (refused if the instance failed meanwhile)."""
        authorize(principal, (Role.CONTROLLER,))
        self.lead.check()
        self.instances.check_set_state(url, state)
        await self.peers.set_state(self.instances.get(url).url, state)
        await self._wake_or_drain(url, state)

    async def _wake_or_drain(self, url: str, state: InstanceState) -> None:
        self.instances.set_state(url, state)
        await self._write(PutInstance(self.instances.get(url)))

    async def readiness(self) -> list[str]:
        """Why this controller should get no traffic now (``readyz``): it does not lead (a
        standby, or a leader whose state store stopped answering within its lease), or no
        instance is active to place a request on."""
        reasons = []
        if not self.lead.leading():
            reasons.append(f"not leading (the leader is {self.lead.leader or 'unknown'})")
        if not self.instances.active():
            reasons.append("no active instance")
        return reasons

    def lead_view(self) -> dict[str, Any]:
        """Whether this controller leads, and which one does (``healthz``)."""
        role = "leader" if self.lead.leading() else "standby"
        return {"role": role, "leader": self.lead.leader, "state": self.store.name}

    def session_view(self, principal: Principal, session: str) -> dict[str, Any]:
        authorize(principal, OPERATOR_ROLES)
        self.lead.check()
        doc = self.sessions.get_for(principal, session).to_json()
        hints = None if self.hints is None else self.hints.table.get(session)
        if hints is not None:
            doc["hints"] = hints.to_json()
        return doc

    def shard_view(self, map_id: str) -> dict[str, Any]:
        self.lead.check()
        current = self.reshards.current(map_id)
        return {"map": current.to_json(), "in_flight": self.reshards.in_flight(map_id)}

    def instance_view(self) -> list[dict[str, Any]]:
        self.lead.check()
        now = self.clock.now_ms()
        out = []
        for i in self.instances:
            out.append(
                {
                    "instance": i.url,
                    "state": i.state.value,
                    "epoch": i.epoch,
                    "running": i.status.running,
                    "queued": i.status.queued,
                    "kv_utilization": i.status.kv_utilization,
                    "g2_utilization": i.status.g2_utilization,
                    "status_expires_in_ms": max(0, i.expires_at - now),
                    "last_placement": self.last_costs.get(i.url),
                }
            )
        return out

    def cluster_view(self) -> dict[str, Any]:
        """Everything the live cluster page shows (``GET ui/state``): instances, the latest
        sessions, the last placements with their candidates' cost terms, per-tenant reuse,
        and the KvHint outcomes so far."""
        hints = [
            {"action": s.labels["action"], "outcome": s.labels["outcome"], "count": s.value}
            for family in self.metrics.hint_outcomes.collect()
            for s in family.samples
            if s.name.endswith("_total")
        ]
        return {
            "controller": self.config.url,
            "at_ms": self.clock.now_ms(),
            "instances": self.instance_view(),
            "sessions": [s.to_json() for s in self.sessions.latest(UI_SESSIONS)],
            "placements": self.placement_log.recent(),
            "hit_rates": self.placement_log.hit_rates(),
            "hints": hints,
        }

    # -- placement -----------------------------------------------------------------------------

    async def _lookup(self, request: PlacementRequest, targets: Sequence[str]) -> LookupResponse:
        """The IS's answer for the request's keys. A prompt with a shared prefix is looked up
        in each scope in turn (the tenant's part only when the whole shared part matched), and
        the answers joined without estimates: the PC computes the costs from the replicas."""
        empty = LookupResponse(matched=0)
        if self.index is None or not request.block_keys:
            return empty
        parts = [(scope, keys) for scope, keys in request.parts() if keys]
        answers: list[LookupResponse] = []
        try:
            for scope, keys in parts:
                answer = await self.index.lookup(
                    LookupRequest(
                        scope_id=scope,
                        compat_id=request.compat_id,
                        block_keys=keys,
                        targets=(tuple(targets) or None) if len(parts) == 1 else None,
                        block_tokens=request.block_tokens,
                    )
                )
                answers.append(answer)
                if answer.matched < len(keys):
                    break
        except KvspError as exc:  # placement still works: everything is recomputed
            log.warning("index lookup failed (%s); placing without cached blocks", exc.detail)
            return empty
        if len(answers) == 1:
            return answers[0]
        return LookupResponse(
            matched=sum(a.matched for a in answers),
            replicas=tuple(r for a in answers for r in a.replicas),
        )

    async def _request(
        self, tenant: Tenant, compat_id: str, tokens: Sequence[int]
    ) -> PlacementRequest:
        """The prompt's Block Keys in the tenant's scope (a shared prefix's first), as placement
        and the router query look them up."""
        b = self.config.block_tokens
        chain = tenant.chain(compat_id, b)
        keys = await _block_keys(chain, tokens, b)
        shared = None if chain.shared is None else chain.shared.scope_id
        return PlacementRequest(
            tenant.scope_id, compat_id, keys, len(tokens), b, shared, chain.shared_count
        )

    async def query_prefix(
        self,
        principal: Principal,
        tenant_name: str,
        compat_id: str | None,
        tokens: Sequence[int],
    ) -> dict[str, Any]:
        """Where the prompt's prefix is cached, per instance and medium, with the cost of
        serving it at each active instance: the router query (``controller/overlap.py``)."""
        authorize(principal, (Role.ROUTER,))
        self.lead.check()
        tenant = self.config.tenants.for_principal(principal, tenant_name)
        if compat_id is None:
            if len(tenant.compat_ids) != 1:
                raise InvalidInput(f"tenant {tenant.name} has several models: name one")
            (compat_id,) = tenant.compat_ids
        tenant.check_compat(compat_id)
        b = self.config.block_tokens
        request = await self._request(tenant, compat_id, tokens)
        active = [i.status for i in self.instances.active()]
        lookup = await self._lookup(request, [s.instance for s in active])
        report = prefix_report(
            lookup.replicas, active, b, len(tokens), self.config.placement.mean_service_us
        )
        return {
            "model": compat_id,
            "tenant": tenant.name,
            "block_tokens": b,
            "prompt_tokens": len(tokens),
            "matched_blocks": lookup.matched,
            **report,
        }

    async def place(
        self,
        principal: Principal,
        tenant_name: str,
        compat_id: str,
        tokens: Sequence[int],
        session: str | None = None,
        sampler: Sampler | None = None,
        request_ref: str | None = None,
        wait_prefetch: bool = False,
        max_tokens: int | None = None,
    ) -> Placement:
        """Choose an instance for a prompt of ``tokens``; wake or launch one when needed, and
        prefetch its cached prefix where that pays."""
        authorize(principal, OPERATOR_ROLES)
        self.lead.check()
        tenant = self.config.tenants.for_principal(principal, tenant_name)
        tenant.check_compat(compat_id)
        if session is not None:  # the tenant's own name for it, in the tenant's namespace
            session = tenant_session(tenant.scope_id, session)
        block_tokens = self.config.block_tokens
        request = await self._request(tenant, compat_id, tokens)
        keys = request.block_keys
        first = None
        if session is not None:
            blocks, tail, last_block = split_prompt(tokens, block_tokens)
            first = SessionCheckpoint(
                session=session,
                epoch=0,
                compat_id=compat_id,
                scope_id=tenant.scope_id,
                prompt_blocks=keys[:blocks],
                prompt_tail=tail,
                generated=(),
                output_offset=0,
                sampler=sampler or Sampler(method="greedy", deterministic=True),
                last_block=last_block,
            )
        with tracing.span("kvsp.placement", tenant=tenant.name, blocks=len(keys)):
            active = [i.status for i in self.instances.active()]
            sleeping = [i.status for i in self.instances.sleeping()]
            lookup = await self._lookup(request, [s.instance for s in active + sleeping])
            decision = place(request, lookup, active, sleeping, self.config.placement)
            decision = await self._act_on(decision, request, lookup)
        self.metrics.placements.labels(decision.outcome.value).inc()
        chosen = decision.chosen
        if chosen is not None:
            self.metrics.predicted_ttft.observe(chosen.cost_us / 1e6)
            for c in decision.candidates:
                self.last_costs[canonical_url(c.instance)] = {
                    "cost_us": round(c.cost_us, 1),
                    "reused_tokens": c.reused_tokens,
                    "chosen": c.instance == decision.instance,
                }
        decision_id = str(uuid.uuid4())
        decided = decision.to_json()
        log.info("placement %s %s", decision_id, decided)
        self.placement_log.record(self.clock.now_ms(), tenant.name, len(keys), decided)
        changes: list[Change] = []
        if chosen is not None:
            self._predictions[decision_id] = chosen.cost_us
            changes.append(PutDecision(decision_id, chosen.cost_us))
            while len(self._predictions) > MAX_PREDICTIONS:
                changes.append(DropDecision(self._predictions.popitem(last=False)[0]))
        placement = Placement(decision, keys, decision_id, session=session)
        if decision.instance is None:
            await self._write(*changes)
            return placement
        policy = self.config.placement
        directive = build_directive(request, lookup, decision.instance, policy, request_ref)
        pays = chosen is None or chosen.uses_cache
        # a directive names one scope: a prompt with a shared prefix loads it itself
        if directive is not None and policy.prefetch and pays and not request.shared_blocks:
            with tracing.span("kvsp.prefetch", instance=decision.instance):
                placement = await self._prefetch(
                    placement, decision.instance, directive, wait_prefetch
                )
        if first is None:
            await self._write(*changes)
            return placement
        async with self._session_locks.hold(first.session):
            placement, planned = await self._open(first, placement, max_tokens, changes)
        if planned:  # the KV moves with the session, while the request is placed
            self._later.run(
                self._send_hints(first.session, tenant.scope_id, planned),
                f"hints for session {first.session}",
            )
        return placement

    async def _open(
        self,
        first: SessionCheckpoint,
        placement: Placement,
        max_tokens: int | None,
        changes: list[Change],
    ) -> tuple[Placement, list[PlannedHint]]:
        """Open the placed session (or its next turn), and write it with the decision."""
        instance = placement.decision.instance
        assert instance is not None  # a placed session has its instance
        eligible = [s.status for s in self.instances.active() + self.instances.sleeping()]
        served = next((s for s in eligible if canonical_url(s.instance) == instance), None)
        first = first.model_copy(update={"sampler": sampler_for(first.sampler, served, eligible)})
        engine = None if served is None else served.engine
        entry = self.sessions.open(first, instance, max_tokens, engine)
        now = self.clock.now_ms()
        changes.append(PutSession(entry, now))
        changes.extend(DropSession(e.scope_id, e.session) for e in self.sessions.take_evicted())
        planned: list[PlannedHint] = []
        if self.hints is not None:
            planned = self.hints.table.turn_started(entry.session, entry.instance, now)
            changes.extend(self._hint_changes(entry.scope_id, entry.session))
        await self._write(*changes)
        placed = dataclasses.replace(placement, session_epoch=entry.epoch, sampler=first.sampler)
        return placed, planned

    def _hint_changes(self, scope_id: str, session: str) -> list[Change]:
        found = None if self.hints is None else self.hints.table.get(session)
        return [] if found is None else [PutHints(scope_id, found)]

    async def _send_hints(
        self,
        session: str,
        scope_id: str,
        planned: list[PlannedHint],
        ended: SessionHints | None = None,
    ) -> list[dict[str, Any]]:
        """Send ``planned``; the outcomes the policy learnt from are written."""
        if self.hints is None:
            return []
        outcomes = await self.hints.send(session, planned, ended)
        if ended is None:
            await self._write(*self._hint_changes(scope_id, session))
        return outcomes

    # -- KvHints (session-aware KV) ------------------------------------------------------------

    async def turn_ended(
        self,
        principal: Principal,
        session: str,
        tool_call: bool,
        expected_gap_ms: int | None = None,
    ) -> list[dict[str, Any]]:
        """A turn of ``session`` is over (its output delivered): tell the instance holding its
        KV what the policy says; the outcomes."""
        authorize(principal, OPERATOR_ROLES)
        self.lead.check()
        async with self._session_locks.hold(session):
            entry = self.sessions.get_for(principal, session)
            entry.turn_done = True
            planned: list[PlannedHint] = []
            if self.hints is not None:
                planned = self.hints.table.turn_ended(
                    session, entry.instance, self.clock.now_ms(), tool_call, expected_gap_ms
                )
            await self._write(PutSession(entry, self.clock.now_ms()))
        return await self._send_hints(session, entry.scope_id, planned)

    async def end_session(self, principal: Principal, session: str) -> list[dict[str, Any]]:
        """The session is over: the policy's last hints, then the instance forgets it."""
        authorize(principal, OPERATOR_ROLES)
        self.lead.check()
        async with self._session_locks.hold(session):
            self.sessions.get_for(principal, session)
            entry = self.sessions.close(session)
            ended, planned = (None, []) if self.hints is None else self.hints.table.ended(session)
            await self._write(DropSession(entry.scope_id, session))
        outcomes = await self._send_hints(session, entry.scope_id, planned, ended)
        try:
            await self.peers.end_session(entry.instance, session)
        except KvspError as exc:
            log.warning("session %s not ended at %s: %s", session, entry.instance, exc.detail)
        return outcomes

    async def forget_session(self, principal: Principal, session: str) -> None:
        """A request's own session is done: the controller and its instance forget it, with
        no hints (nothing will come back to it)."""
        authorize(principal, OPERATOR_ROLES)
        self.lead.check()
        async with self._session_locks.hold(session):
            self.sessions.get_for(principal, session)
            entry = self.sessions.close(session)
            if self.hints is not None:
                self.hints.table.forget(session)
            await self._write(DropSession(entry.scope_id, session))
        self._later.run(
            self.peers.end_session(entry.instance, session),
            f"session {session} not ended at {entry.instance}",
        )

    async def abandon_turn(self, principal: Principal, session: str) -> None:
        """The client went away mid-turn: the instance stops generating and lets go of the
        session's KV; the conversation stays known for its next turn."""
        authorize(principal, OPERATOR_ROLES)
        self.lead.check()
        async with self._session_locks.hold(session):
            entry = self.sessions.get_for(principal, session)
            entry.turn_done = True
            await self._write(PutSession(entry, self.clock.now_ms()))
        self._later.run(
            self.peers.end_session(entry.instance, session),
            f"session {session} not stopped at {entry.instance}",
        )

    async def observe_ttft(self, principal: Principal, decision_id: str, ttft_us: float) -> float:
        """The measured time to first token of a placed request; returns the prediction."""
        authorize(principal, OPERATOR_ROLES)
        self.lead.check()
        predicted = self._predictions.pop(decision_id, None)
        if predicted is None:
            raise NotFound(f"no recent decision {decision_id} waits for its TTFT")
        await self._write(DropDecision(decision_id))
        self.metrics.measured_ttft.observe(ttft_us / 1e6)
        if predicted > 0:
            self.metrics.ttft_ratio.observe(ttft_us / predicted)
        return predicted

    async def _act_on(
        self, decision: Decision, request: PlacementRequest, lookup: LookupResponse
    ) -> Decision:
        """Wake the instance a decision names, or launch one."""
        if decision.outcome is Outcome.WAKE and decision.instance is not None:
            try:
                self.instances.check_set_state(decision.instance, InstanceState.ACTIVE)
                await self.peers.set_state(decision.instance, InstanceState.ACTIVE)
                await self._wake_or_drain(decision.instance, InstanceState.ACTIVE)
            except KvspError as exc:
                log.warning("could not wake %s: %s", decision.instance, exc.detail)
                return Decision(
                    Outcome.NONE,
                    None,
                    decision.candidates,
                    decision.matched_blocks,
                    0,
                    f"wake of {decision.instance} failed: {exc.detail}",
                )
        elif decision.outcome is Outcome.LAUNCH and self.launcher is not None:
            url = await self.launcher.launch()
            if url is not None:
                return Decision(
                    Outcome.LAUNCH,
                    canonical_url(url),
                    decision.candidates,
                    decision.matched_blocks,
                    0,
                    decision.reason,
                )
        return decision

    async def _prefetch(
        self, placement: Placement, instance: str, directive: Any, wait: bool
    ) -> Placement:
        try:
            location = await self.peers.prefetch(instance, directive)
        except KvspError as exc:
            log.warning("prefetch to %s failed: %s", instance, exc.detail)
            self.metrics.prefetches.labels("unsent").inc()
            return placement
        state = PrefetchState.PENDING.value
        loaded: tuple[str, ...] = ()
        if wait:
            deadline = self.clock.now_ms() + directive.deadline_ms
            while True:
                try:
                    status = await self.peers.prefetch_status(location)
                except KvspError:
                    break
                state, loaded = status.state.value, status.loaded
                if status.state is not PrefetchState.PENDING or self.clock.now_ms() >= deadline:
                    break
                await asyncio.sleep(0.01)
            self.metrics.prefetches.labels(state).inc()
        return dataclasses.replace(
            placement, directive=directive.directive, prefetch_state=state, loaded=tuple(loaded)
        )

    # -- sessions ------------------------------------------------------------------------------

    async def put_checkpoint(
        self, principal: Principal, session: str, checkpoint: SessionCheckpoint
    ) -> CheckpointAnswer:
        """Record a checkpoint, and acknowledge it only once the store has it: checked by the
        table, decided by the store (its epoch rules run there), applied to the table."""
        authorize(principal, Role.INSTANCE, scope=checkpoint.scope_id)
        if checkpoint.session != session:
            raise RecordError("the checkpoint names another session than its path")
        self.lead.check()
        async with self._session_locks.hold(session):
            serving = self.sessions.get(session).instance
            reporter = canonical_url(serving if principal.may_act_for(serving) else principal.name)
            if self.sessions.check_checkpoint(checkpoint, reporter):
                token = self.lead.check()
                try:
                    await self.store.checkpoint(token, checkpoint, reporter)
                except NotLeader as exc:
                    self.lead.depose(exc.detail)
                    raise
            return self.sessions.put_checkpoint(checkpoint, reporter)

    async def _fail_over(self, session: str, failed: str, epoch: int) -> None:
        """Resume ``session`` elsewhere: place it again, move it in the store (a new epoch),
        resume it there, and only then move it in the table, so that ``GET sessions/{s}``
        names an instance that has it. The session's lock is held throughout: the new
        instance's first checkpoints wait for the move instead of being refused. Nothing when
        it is no longer at epoch ``epoch`` on ``failed``. An instance that refuses the resume
        is passed over: the session moves on (another epoch) to the next one that can take
        it; if none can, the table follows the store to the last one tried."""
        refused: set[str] = set()
        async with self._session_locks.hold(session):
            try:
                entry = self.sessions.get(session)
            except NotFound:
                return  # over, or forgotten
            if (entry.instance, entry.epoch) != (failed, epoch):
                return  # moved or resumed already
            moved: tuple[str, SessionCheckpoint] | None = None
            elsewhere = False  # the store has it where this table did not look
            while (target := await self._resumer(entry, refused)) is not None:
                resumed = await self._move(entry, failed, epoch, target)
                if resumed is None:
                    elsewhere = True
                    break
                moved = target, resumed
                try:
                    await self.peers.resume(target, resumed, entry.max_tokens)
                except KvspError as exc:
                    log.error("session %s: resume at %s failed: %s", session, target, exc)
                    self.metrics.failovers.labels("failed").inc()
                    refused.add(target)
                    failed, epoch = target, resumed.epoch
                    continue
                self.metrics.failovers.labels("resumed").inc()
                log.info("session %s resumed at %s, epoch %d", session, target, resumed.epoch)
                break
            if moved is not None:
                self.sessions.move(session, *moved)
            settled = None if elsewhere else self.sessions.settle(session)
            if settled is not None:  # over: resumed, or nowhere to resume it
                await self._write(PutPending(settled))

    async def _move(
        self, entry: Session, failed: str, epoch: int, target: str
    ) -> SessionCheckpoint | None:
        """Move ``entry`` in the store from ``failed`` at ``epoch`` to ``target`` (a
        controller that lost its lease moves nothing): the checkpoint to resume from, with
        the new epoch; None if the store has the session elsewhere."""
        token = self.lead.check()
        try:
            moved, latest = await self.store.move(
                token, entry.scope_id, entry.session, failed, epoch, target
            )
        except KvspError as exc:
            self.lead.depose(exc.detail)
            raise
        if not moved:
            return None
        return self.sessions.resume_point(entry.session, epoch + 1, latest)

    async def _resumer(self, entry: Session, refused: set[str]) -> str | None:
        """The instance to resume ``entry`` on (placed by cost, among those that may)."""
        session = entry.session
        blocks = entry.checkpoint.prompt_blocks
        b = self.config.block_tokens
        tenant = self.config.tenants.by_scope(entry.scope_id)
        chain = tenant.chain_after(entry.compat_id, b, blocks) if tenant is not None else None
        request = PlacementRequest(
            entry.scope_id,
            entry.compat_id,
            blocks,
            len(blocks) * b + len(entry.checkpoint.prompt_tail) + entry.checkpoint.output_offset,
            b,
            None if chain is None or chain.shared is None else chain.shared.scope_id,
            0 if chain is None else chain.shared_count,
        )
        candidates = [i.status for i in self.instances.active()]
        active = [
            s for s in resumers(entry, candidates) if canonical_url(s.instance) not in refused
        ]
        lookup = await self._lookup(request, [s.instance for s in active])
        decision = place(request, lookup, active, [], self.config.placement)
        if decision.instance is None:
            if entry.checkpoint.sampler.deterministic:  # another engine may alter its output
                log.error("session %s: no instance with engine %s", session, entry.engine)
            log.error("session %s: no instance to resume on (%s)", session, decision.reason)
            self.metrics.failovers.labels("no-instance").inc()
            return None
        return canonical_url(decision.instance)

    # -- resharding ----------------------------------------------------------------------------

    async def register_map(self, principal: Principal, shard_map: ShardMap) -> None:
        authorize(principal, (Role.CONTROLLER,))
        self.lead.check()
        self.reshards.register(shard_map)
        await self._write(PutMap(shard_map))

    async def reshard(
        self,
        principal: Principal,
        map_id: str,
        target: ShardMap | None,
        instances: Sequence[str] | None,
        deadline_ms: int,
    ) -> ReshardResult:
        """Move ``map_id`` to ``target`` (or to a proposal over ``instances``): send every
        member its plan, then commit when all acknowledged, or abort."""
        authorize(principal, (Role.CONTROLLER,))
        self.lead.check()
        current = self.reshards.current(map_id)
        if target is None:
            if not instances:
                raise RecordError("a reshard needs a target map or a list of instances")
            target = propose(current, instances)
        plans = self.reshards.begin(target, deadline_ms)
        # in flight: a leader taking over aborts it (v stays), unless its commit was written
        begun = {"map": map_id, "version": target.version, "commit": False, "members": list(plans)}
        await self._write(PutReshard(map_id, begun))

        async def send(instance: str) -> ReshardResult | None:
            try:
                await self.peers.reshard(instance, plans[instance], timeout_s=deadline_ms / 1000)
            except KvspError as exc:
                log.warning("reshard plan to %s: %s", instance, exc.detail)
                return self.reshards.abort(map_id, f"{instance} did not acknowledge")
            if self.reshards.in_flight(map_id) != target.version:
                return None  # already aborted by another member
            return self.reshards.acknowledge(map_id, instance, target.version)

        outcomes = await asyncio.gather(*(send(i) for i in plans))
        result = next((r for r in outcomes if r is not None and not r.commit), None)
        result = result or next((r for r in outcomes if r is not None), None)
        if result is None:  # cannot happen: every member either acknowledged or aborted
            result = self.reshards.abort(map_id, "incomplete") or ReshardResult(
                map_id, target.version, False, tuple(plans), "incomplete"
            )
        await self._finish_reshard(result)
        return result

    async def _finish_reshard(self, result: ReshardResult) -> None:
        """Commit (v+1 and the outcome in one write, before any member hears of it) or
        abort, then tell every member."""
        outcome = {"map": result.map, "version": result.version, "commit": result.commit,
                   "members": list(result.members)}  # fmt: skip
        changes: list[Change] = [PutReshard(result.map, outcome)]
        if result.commit:
            changes.append(PutMap(self.reshards.current(result.map)))
        await self._write(*changes)
        self.metrics.reshard_results.labels("committed" if result.commit else "aborted").inc()
        await self._announce_reshard(result)

    async def _announce_reshard(self, result: ReshardResult) -> None:
        """Send a written outcome to every member, then forget it."""
        message: ReshardCommit | ReshardAbort = (
            ReshardCommit(map=result.map, commit=result.version)
            if result.commit
            else ReshardAbort(map=result.map, abort=result.version)
        )
        for member in result.members:
            try:
                await self.peers.reshard(member, message)
            except KvspError as exc:
                log.warning(
                    "reshard %s to %s: %s", "commit" if result.commit else "abort", member, exc
                )
        await self._write(PutReshard(result.map, None))
