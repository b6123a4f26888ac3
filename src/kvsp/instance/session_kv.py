"""Session-aware KV management at the instance: the SessionPrefixIndex kept in step with the
pool, the engine's events, and KvHints executed against the pool.

- **Membership.** A request that reuses blocks makes its session a member of them (``reused``);
  every block a request completes joins its session's branch (``completed``). With the index
  off (the default) neither costs anything.
- **Residency.** The embedded holder reports every publish and withdraw (``observe``, in order,
  on the event loop): the index learns which local tiers hold each block, and the event log gets
  ``residency`` (when the tiers change) and ``eviction`` events.
- **Hints.** ``execute`` answers every action of an envelope with an outcome: targets resolve
  through the index (a session) or as exact block keys of a scope the caller may use; Retain,
  Pin, Demote and Prefetch run on the store's thread (``hints.LocalHints``); Share copies the
  blocks to a destination holder or instance with PUT, holding them in use here meanwhile, so
  the destination verifies and publishes each block only once it has all of it; the source
  keeps its copy. Each outcome is also an event.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator, Sequence

from prometheus_client import Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvsp.auth import Principal, authorize
from kvsp.core.container import Container
from kvsp.core.hints import (
    HintAction,
    HintOutcome,
    HintPayload,
    KvHints,
    Reason,
    action_name,
    read_action,
    rejection,
)
from kvsp.core.problems import KvspError
from kvsp.core.records import HttpUrl
from kvsp.holder.blocks import BlockId
from kvsp.holder.client import MOQT_SKIPS, HolderClient
from kvsp.holder.service import BLOCK_ROLES, HolderService
from kvsp.holder.store import Effect, Publish
from kvsp.instance.events import EventLog
from kvsp.instance.hints import (
    HintLimits,
    LocalHints,
    PinTable,
    engine_kept,
    engine_prefetch,
)
from kvsp.instance.kvpool import BlockRefs
from kvsp.instance.session_index import SessionPrefixIndex
from kvsp.instance.share import share_blocks
from kvsp.kvevents.publisher import PublishedFeed
from kvsp.kvevents.wire import MEDIUM_OF_TIER

__all__ = ["SessionKv"]

log = logging.getLogger("kvsp.instance.hints")

#: the pool's tiers as the RFC names them
LOCAL = {"device": "g1", "host": "g2", "disk": "g2"}
_G1 = frozenset({"g1"})


def _ref(block: BlockId) -> dict[str, str]:
    return {"scope_id": block[1], "block_key": block[2]}


class SessionKv:
    def __init__(
        self,
        holder: HolderService,
        peers: HolderClient,
        in_use: BlockRefs,
        pins: PinTable,
        g1_layers: int | None,
        index_sessions: bool,
        events: int = 4096,
        engine_g1: bool = False,
        kv_events: PublishedFeed | None = None,
    ) -> None:
        self.holder = holder
        self.peers = peers
        self.in_use = in_use
        self.pins = pins
        self.index: SessionPrefixIndex[BlockId] | None = (
            SessionPrefixIndex() if index_sessions else None
        )
        self.events = EventLog(holder.clock, events)
        self.local = LocalHints(holder.store, pins, pins.limits, g1_layers)
        #: the pool's tiers of every block the holder keeps, to report changes only
        self._tiers: dict[BlockId, frozenset[str]] = {}
        #: vLLM-format KV events for routers and indexers (None: not published)
        self.kv_events = kv_events
        #: blocks in the engine's own pages (vLLM's G1), when the engine keeps them apart from
        #: the pool; None when G1 is the pool's device tier
        self.engine_g1: set[BlockId] | None = set() if engine_g1 else None
        registry = holder.registry
        self.outcomes = Counter(
            "kvsp_instance_hints", "KvHint actions, by action type and outcome",
            ["action", "outcome"], registry=registry,
        )  # fmt: skip
        Gauge(
            "kvsp_instance_pinned_bytes", "Octets pinned by KvHints", registry=registry
        ).set_function(lambda: self.pins.octets)
        Gauge(
            "kvsp_instance_indexed_blocks", "Blocks in the SessionPrefixIndex", registry=registry
        ).set_function(lambda: 0 if self.index is None else len(self.index))
        Gauge(
            "kvsp_instance_indexed_sessions",
            "Sessions in the SessionPrefixIndex",
            registry=registry,
        ).set_function(lambda: 0 if self.index is None else len(self.index.sessions()))
        Gauge(
            "kvsp_instance_last_event", "Sequence number of the latest event", registry=registry
        ).set_function(lambda: self.events.last)
        registry.register(_PerScope(self))

    @property
    def limits(self) -> HintLimits:
        return self.pins.limits

    # -- membership and residency --------------------------------------------------------------

    def reused(
        self, session: str, blocks: Sequence[BlockId], tokens: Sequence[Sequence[int] | None]
    ) -> None:
        """A request of ``session`` reused these chained blocks, from the root on (``tokens``:
        each block's, None where the request does not know them)."""
        if not blocks:
            return
        if self.kv_events is not None:
            for i, block in enumerate(blocks):
                self._learn(session, block, blocks[i - 1] if i else None, tokens[i])
            self.kv_events.flush()
        if self.index is not None:
            self.index.hit(session, blocks, [self._local(b) for b in blocks])
        self.events.append("association", session=session, blocks=[b[2] for b in blocks])

    def completed(
        self,
        session: str,
        block: BlockId,
        parent: BlockId | None,
        tokens: Sequence[int] | None = None,
    ) -> None:
        """A request of ``session`` completed ``block`` (after ``parent``; ``tokens``: its
        tokens, where the request knows them)."""
        if self.kv_events is not None:
            self._learn(session, block, parent, tokens)
            self.kv_events.flush()
        if self.index is not None:
            if parent is not None and parent not in self.index:
                return  # its branch was dropped meanwhile; the block joins on its next hit
            self.index.hit(session, [block], [self._local(block)], parent)
        self.events.append("association", session=session, blocks=[block[2]])

    def _learn(
        self, session: str, block: BlockId, parent: BlockId | None, tokens: Sequence[int] | None
    ) -> None:
        if tokens is not None and self.kv_events is not None:
            self.kv_events.feed.learn(block, parent, tokens, session)

    def observe(self, effects: Sequence[Effect]) -> None:
        """The holder published or withdrew blocks (in order)."""
        for effect in effects:
            if isinstance(effect, Publish):
                r = effect.record
                block = (r.compat_id, r.scope_id, r.block_key)
                before = self._local(block)
                self._tiers[block] = frozenset(x.tier for x in r.residency)
            else:
                ref = effect.ref
                block = (ref.compat_id, ref.scope_id, ref.block_key)
                before = self._local(block)
                self._tiers.pop(block, None)
            self._settle(block, before)
        if self.kv_events is not None:
            self.kv_events.flush()

    def engine_changed(self, changes: Sequence[tuple[BlockId, bool]]) -> None:
        """Blocks entered (True) or left (False) the engine's own pages."""
        g1 = self.engine_g1
        if g1 is None:
            return
        for block, held in changes:
            before = self._local(block)
            if held:
                g1.add(block)
            else:
                g1.discard(block)
            self._settle(block, before)
        if self.kv_events is not None:
            self.kv_events.flush()

    def _local(self, block: BlockId) -> frozenset[str]:
        """The local tiers holding ``block`` as the RFC names them: the pool's, and the
        engine's pages."""
        tiers = frozenset(LOCAL[t] for t in self._tiers.get(block, ()))
        return tiers | _G1 if self.engine_g1 is not None and block in self.engine_g1 else tiers

    def _media(self, block: BlockId) -> frozenset[str]:
        """The media holding ``block`` as vLLM's KV events name them."""
        media = frozenset(MEDIUM_OF_TIER[t] for t in self._tiers.get(block, ()))
        engine = self.engine_g1 is not None and block in self.engine_g1
        return media | {MEDIUM_OF_TIER["device"]} if engine else media

    def _settle(self, block: BlockId, before: frozenset[str]) -> None:
        """Report a change of ``block``'s local tiers: to the index, and as an event
        (``eviction`` once the last local copy is gone); its media to the KV event feed."""
        if self.kv_events is not None:
            self.kv_events.feed.resident(block, self._media(block))
        tiers = self._local(block)
        if tiers == before:
            return  # a refresh
        if self.index is not None:
            self.index.resident(block, tiers)
        if tiers:
            self.events.append("residency", **_ref(block), tiers=sorted(tiers))
        else:
            self.events.append("eviction", **_ref(block))

    def transfer(self, block: BlockId, source: str, destination: str, octets: int) -> None:
        self.events.append(
            "transfer", **_ref(block), source=source, destination=destination, octets=octets
        )

    def end(self, session: str) -> int:
        """The session is over: its pins go and it owns nothing any more; pins released."""
        if self.index is not None:
            self.index.end(session)
        released = self.pins.release(session)
        self.events.append("association", session=session, ended=True)
        return released

    # -- hints ---------------------------------------------------------------------------------

    async def execute(
        self, principal: Principal, compat_id: str, hints: KvHints
    ) -> list[HintOutcome]:
        outcomes = []
        for action in hints.actions:
            outcome = await self._one(principal, compat_id, action)
            # our names only: a caller's free text must not grow the metric without bound
            self.outcomes.labels(action_name(action) or "unsupported", outcome.outcome).inc()
            self.events.append("hint", message_id=hints.message_id, **outcome.to_json())
            outcomes.append(outcome)
        return outcomes

    async def _one(self, principal: Principal, compat_id: str, action: HintAction) -> HintOutcome:
        def rejected(code: Reason, reason: str) -> HintOutcome:
            return rejection(action, code, reason)

        read = read_action(action)
        if isinstance(read, HintOutcome):
            return read
        name, payload = read
        target = payload.target
        scope, keys = target.scope_id, target.block_keys
        if target.session is not None:
            if self.index is None:
                off = "the session index is off; target block keys instead"
                return rejected(Reason.NO_SESSION_INDEX, off)
            blocks = self.index.blocks(target.session)
            owner = target.session
            if name == "demote":  # blocks other sessions also own stay where they are
                index = self.index
                blocks = [b for b in blocks if index.members(b) <= {target.session}]
        elif scope is not None and keys is not None:
            try:
                authorize(principal, BLOCK_ROLES, scope=scope)
            except KvspError as exc:
                return rejected(Reason.FORBIDDEN, exc.detail)
            blocks = [(compat_id, scope, k) for k in keys]
            owner = f"principal:{principal.name}"
        else:  # the payload model allows neither
            return rejected(Reason.INVALID, "a target is a session or block keys")
        if name == "share" or (name == "prefetch" and payload.destination is not None):
            if payload.destination is None:
                return rejected(Reason.INVALID, "share needs a destination")
            return await self._share(action, payload, blocks, payload.destination)
        g1 = self.engine_g1
        in_g1 = frozenset() if g1 is None else frozenset(b for b in blocks if b in g1)

        def run() -> HintOutcome:
            self.pins.expire()
            if g1 is not None and name == "prefetch":
                return engine_prefetch(action, blocks, in_g1, self.holder.store)
            outcome, held = self.local.prepare(action, payload, blocks)
            if g1 is not None and name == "demote":
                outcome.blocks = len(held)  # the pool is G2 there: each has its verified copy
            elif held:
                outcome = self.local.run(name, outcome, held, payload, owner)
            return outcome if g1 is None else engine_kept(name, outcome, in_g1)

        return await self.holder.call(run)

    async def _share(
        self,
        action: HintAction,
        payload: HintPayload,
        blocks: Sequence[BlockId],
        destination: HttpUrl,
    ) -> HintOutcome:
        def take() -> tuple[HintOutcome, list[tuple[BlockId, Container]]]:
            outcome, held = self.local.prepare(action, payload, blocks)
            out = []
            for block in held:
                read = self.holder.store.get(block)
                out.append((block, read.container()))
            self.in_use.acquire(held)
            return outcome, out

        outcome, taken = await self.holder.call(take)

        async def each() -> AsyncIterator[tuple[BlockId, Container]]:
            for item in taken:
                yield item

        def copied(block: BlockId, octets: int) -> None:
            self.transfer(block, self.holder.url, destination, octets)

        try:
            return await share_blocks(self.peers, destination, outcome, each(), copied)
        finally:
            await self.holder.call(lambda: self.in_use.release([b for b, _ in taken]))


class _PerScope(Collector):
    """Figures read when Prometheus scrapes: pinned octets by scope, and the blocks refused
    because they failed verification."""

    def __init__(self, kv: SessionKv) -> None:
        self._kv = kv

    def collect(self) -> Iterator[Metric]:
        pinned = GaugeMetricFamily(
            "kvsp_instance_pinned_scope_bytes",
            "Octets pinned by KvHints, by scope",
            labels=["scope"],
        )
        for scope, octets in self._kv.pins.octets_by_scope().items():
            pinned.add_metric([scope], octets)
        yield pinned
        yield CounterMetricFamily(
            "kvsp_instance_blocks_refused",
            "Blocks fetched from holders that failed verification (never used or published)",
            value=self._kv.peers.refused,
        )
        yield CounterMetricFamily(
            "kvsp_instance_moqt_replicas_skipped",
            "Replicas passed over because they are served only through MOQT",
            value=MOQT_SKIPS.total,
        )
