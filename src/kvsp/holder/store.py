"""The tiered block store, pure: which layers of which block sit in which tier, how much room
each tier has, what to demote or evict to make room, and what the Index Service must be told.

The same store runs inside a standalone holder (tiers host and disk) and inside an inference
instance (whose device tier is the engine's KV pool); where octets live is behind ``TierData``,
so the store itself does no I/O of its own and never imports HTTP or asyncio.

Contract (tested exactly):

- Tiers are ordered fastest first. A block keeps at most one contiguous layer range per tier,
  faster tiers holding earlier layers, so the ranges partition the block's layers in tier order
  (a block may keep layers 0-19 in host memory and 20-29 on disk) and demoting a tier's range
  into the next tier always leaves one contiguous range there.
- A new block goes to the first tier that can hold all of it (or to an explicit placement).
  Room is made in a tier by taking victims in eviction order: from the scope (tenant) holding
  the most octets of the tier first (each scope's fair share of a tier is equal, so that is the
  one furthest over its share: a tenant's flood evicts its own blocks, never all of another's),
  and within a scope lowest effective priority first (``retain`` raises a block's priority
  until a deadline), then least recently used (``put`` and ``get`` use a block). A victim's
  range moves to the next tier when that tier could hold it (making room there the same way);
  otherwise the whole block is dropped.
- A leased block is never demoted or dropped by pressure: it is passed over, and a tier whose
  room is taken by leased blocks refuses new blocks with ``CapacityExhausted`` (507) before
  anything is moved.
- A scope with a stored-octets quota (``kvsp.quotas``) stays within it: a new block of the
  scope first drops the scope's own blocks (slowest tier first), and is refused with
  ``CapacityExhausted`` naming the quota, before anything is dropped, when that cannot make the
  room.
- Every stored or moved block yields a ``Publish`` effect with its current Replica Record; every
  dropped block yields a ``Withdraw`` first. ``refresh_due`` republishes records past half their
  TTL. A block whose octets fail verification on read is withdrawn and dropped even if leased
  (the fault case of KVSP 6.6), in that order: it is gone from every query at once, but its
  octets stay charged until ``forget_withdrawn`` says the withdrawal reached the Index Service
  (its ``Withdraw`` has ``then_forget``). Blocks are found by key alone with ``by_key`` (a Block
  Key names one scope and Compatibility ID). Effects are drained with ``take_effects``.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvsp.core.clock import Clock
from kvsp.core.container import Container, ContainerHeader
from kvsp.core.deadlines import Deadlines
from kvsp.core.problems import (
    AlreadyStored,
    CapacityExhausted,
    ConfigurationError,
    DigestError,
    LayersUnavailable,
    NotFound,
)
from kvsp.core.records import ReplicaRecord, ReplicaRef, Residency
from kvsp.core.registries import Tier
from kvsp.holder.blocks import BlockId, BlockMeta, block_ref
from kvsp.quotas import Quotas

__all__ = [
    "BlockRead",
    "BlockStore",
    "Effect",
    "LeaseView",
    "Protected",
    "Publish",
    "Span",
    "StoreStats",
    "TierData",
    "TierSpec",
    "Withdraw",
]

#: A layer range, inclusive.
Span = tuple[int, int]


@dataclass(frozen=True, slots=True)
class TierSpec:
    name: Tier
    capacity: int
    #: the rate the holder reads this tier at, reported in Replica Records
    read_mbit_per_s: float | None = None


class TierData(Protocol):
    """Where one tier keeps its octets: at most one contiguous layer range per block."""

    def accepts(self, meta: BlockMeta, span: Span) -> bool:
        """Whether this tier can keep ``span`` of such a block at all (room aside)."""
        ...

    def write(
        self, block: BlockId, meta: BlockMeta, span: Span, data: Sequence[memoryview]
    ) -> None:
        """Store the octets of ``span`` (given as consecutive buffers), replacing any range
        the block had in this tier."""
        ...

    def read(self, block: BlockId, meta: BlockMeta, stored: Span, span: Span) -> memoryview:
        """The octets of ``span``, a part of the ``stored`` range; ``DigestError`` if they no
        longer match the meta's layer digests."""
        ...

    def delete(self, block: BlockId) -> None: ...


class LeaseView(Protocol):
    def leased(self, block: BlockId) -> bool: ...

    def leased_blocks(self) -> Iterable[BlockId]: ...

    def leased_count(self) -> int:
        """No fewer than the blocks leased (a cheap upper bound serves)."""
        ...

    def ended(self) -> int:
        """A count that changes whenever a block may have stopped being held (leases or uses
        ended): the store takes back the leased blocks it set aside when it does."""
        ...


class Protected:
    """Blocks pressure must not move or drop: those any of the views holds (leased by a
    client, or in use by a running request of an instance)."""

    def __init__(self, *views: LeaseView) -> None:
        self._views = views

    def leased(self, block: BlockId) -> bool:
        return any(view.leased(block) for view in self._views)

    def leased_blocks(self) -> Iterable[BlockId]:
        return set().union(*(view.leased_blocks() for view in self._views))

    def leased_count(self) -> int:
        return sum(view.leased_count() for view in self._views)

    def ended(self) -> int:
        return sum(view.ended() for view in self._views)


@dataclass(frozen=True, slots=True)
class Publish:
    record: ReplicaRecord


@dataclass(frozen=True, slots=True)
class Withdraw:
    ref: ReplicaRef
    #: a faulty block, kept charged until this withdrawal is delivered (``forget_withdrawn``)
    then_forget: bool = False


Effect = Publish | Withdraw


@dataclass(frozen=True, slots=True)
class BlockRead:
    """A layer range ready to send: the header, then the data as consecutive buffers."""

    header: ContainerHeader
    parts: tuple[memoryview, ...]
    #: milliseconds until the published record expires (for ``Cache-Control: max-age``)
    remaining_ttl_ms: int

    @property
    def size(self) -> int:
        return self.header.total_octets

    def container(self) -> Container:
        """The range as a container of its own (its octets copied once)."""
        return Container.parse(b"".join([self.header.encode(), *self.parts]))


@dataclass
class StoreStats:
    """Counters since start, exported as metrics by the adapter."""

    hits: int = 0
    misses: int = 0
    digest_failures: int = 0
    evictions: dict[str, int] = field(default_factory=dict)
    demotions: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Block:
    meta: BlockMeta
    spans: dict[Tier, Span]
    tick: int
    priority: int = 0
    priority_until: int = 0
    published_at: int = 0


class BlockStore:
    def __init__(
        self,
        tiers: Sequence[TierSpec],
        data: Mapping[Tier, TierData],
        leases: LeaseView,
        clock: Clock,
        holder_url: str,
        record_ttl_ms: int = 600_000,
        block_overhead: int = 0,
        quotas: Quotas | None = None,
    ) -> None:
        names = [t.name for t in tiers]
        if not tiers or len(set(names)) != len(names) or set(names) != set(data):
            raise ConfigurationError("each tier needs a distinct name and a place for its data")
        if any(t.capacity < 0 for t in tiers) or record_ttl_ms < 2:
            raise ConfigurationError("tier capacities must be >= 0 and the record TTL >= 2 ms")
        self._tiers = tuple(tiers)
        self._spec = {t.name: t for t in tiers}
        self._data = dict(data)
        self._leases = leases
        self.clock = clock
        self.holder_url = holder_url
        self.record_ttl_ms = record_ttl_ms
        #: octets charged per block beside its data, in the tier holding its first layer (the
        #: device tier's fixed pages excepted): a block's metadata costs memory too, and
        #: 16,000 one-layer blocks of 2 octets once took 34.5 MB while counting 32,000
        self.block_overhead = block_overhead
        #: records are published again this long after they were (half the TTL granted)
        self.refresh_after_ms = record_ttl_ms // 2
        self._blocks: dict[BlockId, _Block] = {}
        self._by_key: dict[str, BlockId] = {}
        #: blocks that failed verification, withdrawn and waiting to be forgotten
        self._faulted: dict[BlockId, _Block] = {}
        self._used: dict[Tier, int] = dict.fromkeys(names, 0)
        #: per tier, octets per scope; and octets per scope over every tier
        self._scope_used: dict[Tier, Counter[str]] = {n: Counter() for n in names}
        self._scope_total: Counter[str] = Counter()
        self.quotas = quotas or Quotas()
        self._ticks = itertools.count(1)
        #: per tier and scope: (priority, tick, block) in eviction order; stale entries are
        #: skipped
        self._order: dict[Tier, dict[str, list[tuple[int, int, BlockId]]]] = {n: {} for n in names}
        #: per tier and scope: entries of ``_order`` set aside because their block was leased
        #: (an eviction would otherwise pop past every leased block each time), with the
        #: count of ended leases when they were; they go back when another lease has ended
        self._parked: dict[Tier, dict[str, tuple[int, list[tuple[int, int, BlockId]]]]] = {
            n: {} for n in names
        }
        #: when raised priorities end, and when records are due to be published again
        self._priority_ends: Deadlines[BlockId] = Deadlines()
        self._refresh: Deadlines[BlockId] = Deadlines()
        self._effects: list[Effect] = []
        self._residencies: dict[tuple[Tier, Span], Residency] = {}
        #: octets of the largest block ever held (bounds what a leased block can occupy)
        self._largest = 0
        self._template = ReplicaRecord.model_construct(
            block_key="", compat_id="", scope_id="", holder=holder_url, codec=0, size=0,
            digest="", layer_digests=(), residency=(), ttl_ms=record_ttl_ms, moqt_namespace=None,
        )  # fmt: skip
        self.stats = StoreStats()

    # -- queries -------------------------------------------------------------------------------

    def __contains__(self, block: object) -> bool:
        return block in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def used(self) -> dict[Tier, int]:
        """Octets held per tier."""
        return dict(self._used)

    def meta(self, block: BlockId) -> BlockMeta:
        found = self._blocks.get(block)
        if found is None:
            raise NotFound(f"{block_ref(block)} is not held here")
        return found.meta

    def by_key(self, key: str) -> BlockId:
        """The block held under Block Key ``key``, whatever its scope; ``NotFound`` if none."""
        found = self._by_key.get(key)
        if found is None:
            raise NotFound(f"block {key} is not held here")
        return found

    def held(self) -> list[BlockId]:
        """Every block held, oldest stored first."""
        return list(self._blocks)

    def in_host(self, block: BlockId) -> bool:
        """Whether every layer of ``block`` is in host memory (it can be read without I/O)."""
        entry = self._blocks.get(block)
        return entry is not None and entry.spans.get("host") == (0, entry.meta.layer_count - 1)

    def spans(self, block: BlockId) -> dict[Tier, Span]:
        return dict(self._blocks[block].spans)

    def record(self, block: BlockId) -> ReplicaRecord:
        return self._record(block, self._blocks[block])

    def take_effects(self) -> list[Effect]:
        effects, self._effects = self._effects, []
        return effects

    # -- storing -------------------------------------------------------------------------------

    def put(
        self,
        block: BlockId,
        meta: BlockMeta,
        data: memoryview,
        placement: Sequence[tuple[Tier, Span]] | None = None,
    ) -> ReplicaRecord:
        """Store a whole block (``data``: the octets of all its layers). A block already held
        is ``AlreadyStored`` and keeps its copy; a block no tier can take is
        ``CapacityExhausted``. Neither changes anything."""
        if block in self._blocks or block in self._faulted:
            raise AlreadyStored(f"{block_ref(block)} is already held here")
        if len(data) != meta.range_octets(0, meta.layer_count - 1):
            raise ValueError("data must hold every layer of the block")
        self._largest = max(self._largest, self._octets("host", meta, (0, meta.layer_count - 1)))
        plan = self._placement(meta, placement)
        self._expire_priorities()
        self._make_scope_room(block[1], sum(self._octets(t, meta, sp) for t, sp in plan), set())
        entry = _Block(meta, {}, next(self._ticks))
        self._add(block, entry)
        try:
            for tier, span in plan:
                self._make_room(tier, self._octets(tier, meta, span), {block}, block[1])
                base = meta.offsets[0]
                lo, hi = meta.offsets[span[0]] - base, meta.offsets[span[1] + 1] - base
                self._data[tier].write(block, meta, span, (data[lo:hi],))
                entry.spans[tier] = span
                self._charge(tier, block, self._octets(tier, meta, span))
                self._push(tier, block, entry)
        except BaseException:
            self._forget(block, entry)
            raise
        return self._published(block, entry)

    def restore(self, block: BlockId, meta: BlockMeta, tier: Tier, span: Span) -> bool:
        """Take back a range that survived a restart in ``tier`` (already verified); False,
        and the range is deleted, when the tier has no room for it."""
        octets = self._octets(tier, meta, span)
        self._largest = max(self._largest, self._octets("host", meta, (0, meta.layer_count - 1)))
        if block in self._blocks or self._used[tier] + octets > self._spec[tier].capacity:
            self._data[tier].delete(block)
            return False
        entry = _Block(meta, {tier: span}, next(self._ticks))
        self._add(block, entry)
        self._charge(tier, block, octets)
        self._push(tier, block, entry)
        self._published(block, entry)
        return True

    def _placement(
        self, meta: BlockMeta, placement: Sequence[tuple[Tier, Span]] | None
    ) -> list[tuple[Tier, Span]]:
        whole = (0, meta.layer_count - 1)
        if placement is None:
            octets = meta.range_octets(*whole)
            for spec in self._tiers:
                charged = self._octets(spec.name, meta, whole)
                room = self._room(spec.name, charged)
                if charged <= room and self._data[spec.name].accepts(meta, whole):
                    return [(spec.name, whole)]
                continue
            raise CapacityExhausted(
                f"no tier can take a block of {octets} octets (leased blocks hold the rest)"
            )
        order = [t.name for t in self._tiers]
        plan = list(placement)
        expected_first = 0
        for i, (tier, (first, last)) in enumerate(plan):
            if tier not in self._spec or first != expected_first or last < first:
                raise ValueError("a placement lists contiguous layer ranges in tier order")
            if not self._data[tier].accepts(meta, (first, last)):
                raise ValueError(f"tier {tier} cannot keep layers {first}-{last} of this block")
            if i and order.index(tier) <= order.index(plan[i - 1][0]):
                raise ValueError("a placement lists contiguous layer ranges in tier order")
            expected_first = last + 1
            charged = self._octets(tier, meta, (first, last))
            if charged > self._room(tier, charged):
                raise CapacityExhausted(f"tier {tier} cannot take layers {first}-{last}")
        if expected_first != meta.layer_count:
            raise ValueError("a placement must cover every layer of the block")
        return plan

    def _octets(self, tier: Tier, meta: BlockMeta, span: Span) -> int:
        """What layers ``span`` of a block count against ``tier``."""
        data = meta.range_octets(*span)
        return data + self.block_overhead if span[0] == 0 and tier != "device" else data

    def _room(self, tier: Tier, wanted: int = 0) -> int:
        """Octets a tier could offer by moving or dropping every block that is not leased.
        With ``wanted``, a lower bound that is at least ``wanted`` when a cheap one shows it
        (its free octets, or the capacity less as many of the largest blocks as are leased),
        or the capacity where even that is short of ``wanted`` (a tier too small, or none: a
        pool with no G2): then nothing is counted."""
        capacity = self._spec[tier].capacity
        if wanted:
            if capacity < wanted:  # no eviction makes room: spare the count of leased blocks
                return capacity
            if capacity - self._used[tier] >= wanted:
                return capacity - self._used[tier]
            bound = capacity - self._leases.leased_count() * self._largest
            if bound >= wanted:
                return bound
        return capacity - self._protected_octets(tier)

    def _protected_octets(self, tier: Tier, other_than: BlockId | None = None) -> int:
        """Octets of ``tier`` held by leased (protected) blocks, ``other_than`` aside."""
        total = 0
        for block in self._leases.leased_blocks():
            entry = self._blocks.get(block)
            if block != other_than and entry is not None and tier in entry.spans:
                total += self._octets(tier, entry.meta, entry.spans[tier])
        return total

    # -- reading -------------------------------------------------------------------------------

    def get(self, block: BlockId, first: int | None = None, last: int | None = None) -> BlockRead:
        """Layers ``first..last`` (default: all) as a container to send; uses the block."""
        entry = self._blocks.get(block)
        if entry is None:
            self.stats.misses += 1
            raise NotFound(f"{block_ref(block)} is not held here")
        meta = entry.meta
        lo = 0 if first is None else first
        hi = meta.layer_count - 1 if last is None else last
        if not self._holds(entry, lo, hi):
            self.stats.misses += 1
            raise LayersUnavailable(f"layers {lo}-{hi} of {block_ref(block)} are not held here")
        parts = []
        for tier, span in self._in_tier_order(entry):
            a, b = max(span[0], lo), min(span[1], hi)
            if a > b:
                continue
            try:
                parts.append(self._data[tier].read(block, meta, span, (a, b)))
            except DigestError as exc:
                self.stats.digest_failures += 1
                self._fault(block, entry)
                raise NotFound(f"{block_ref(block)} failed verification and was dropped") from exc
        self.stats.hits += 1
        self._touch(block, entry)
        remaining = entry.published_at + self.record_ttl_ms - self.clock.now_ms()
        return BlockRead(meta.header(lo, hi), tuple(parts), remaining)

    @staticmethod
    def _holds(entry: _Block, first: int, last: int) -> bool:
        if not 0 <= first <= last < entry.meta.layer_count:
            return False
        covered = first
        for lo, hi in sorted(entry.spans.values()):
            if lo <= covered <= hi:
                covered = hi + 1
        return covered > last

    def _in_tier_order(self, entry: _Block) -> list[tuple[Tier, Span]]:
        return [(t.name, entry.spans[t.name]) for t in self._tiers if t.name in entry.spans]

    def use(self, chain: Sequence[BlockId]) -> None:
        """A request used these blocks of one chain, root first: each counts as used now, the
        root last, so that pressure takes a chain's tail before its head (as vLLM frees a
        request's blocks) and what stays cached is a usable prefix, not the end of one."""
        for block in reversed(chain):
            entry = self._blocks.get(block)
            if entry is not None:
                self._touch(block, entry)

    def _touch(self, block: BlockId, entry: _Block) -> None:
        entry.tick = next(self._ticks)
        for tier in entry.spans:
            self._push(tier, block, entry)

    # -- priorities ----------------------------------------------------------------------------

    def retain(self, block: BlockId, priority: int, until_ms: int) -> None:
        """Evict ``block`` after blocks of lower priority until ``until_ms`` (still evictable)."""
        entry = self._blocks.get(block)
        if entry is None:
            raise NotFound(f"{block_ref(block)} is not held here")
        entry.priority, entry.priority_until = priority, until_ms
        self._priority_ends.set(block, until_ms)
        for tier in entry.spans:
            self._push(tier, block, entry)

    def _effective_priority(self, entry: _Block) -> int:
        return entry.priority if entry.priority_until > self.clock.now_ms() else 0

    def _expire_priorities(self) -> None:
        for block in self._priority_ends.due(self.clock.now_ms()):
            entry = self._blocks.get(block)
            if entry is not None and entry.priority:
                entry.priority = 0
                for tier in entry.spans:
                    self._push(tier, block, entry)

    def _push(self, tier: Tier, block: BlockId, entry: _Block) -> None:
        scope = block[1]
        order = self._order[tier].setdefault(scope, [])
        heapq.heappush(order, (self._effective_priority(entry), entry.tick, block))
        if len(order) > 64 + 4 * len(self._blocks):
            self._parked[tier].pop(scope, None)  # the rebuilt order holds every block
            order[:] = [
                (self._effective_priority(e), e.tick, b)
                for b, e in self._blocks.items()
                if tier in e.spans and b[1] == scope
            ]
            heapq.heapify(order)

    def _charge(self, tier: Tier, block: BlockId, octets: int) -> None:
        """Count ``octets`` more (or fewer) of ``block`` in ``tier``, for it and its scope."""
        scope = block[1]
        self._used[tier] += octets
        self._scope_used[tier][scope] += octets
        self._scope_total[scope] += octets
        if not self._scope_used[tier][scope]:
            del self._scope_used[tier][scope]
            self._order[tier].pop(scope, None)
            self._parked[tier].pop(scope, None)
        if not self._scope_total[scope]:
            del self._scope_total[scope]

    def used_by_scope(self) -> dict[str, int]:
        """Octets held per scope, every tier together."""
        return dict(self._scope_total)

    # -- making room ---------------------------------------------------------------------------

    def _make_room(self, tier: Tier, octets: int, protect: set[BlockId], scope: str) -> None:
        """Room for ``octets`` more of ``scope`` in ``tier``."""
        capacity = self._spec[tier].capacity
        while self._used[tier] + octets > capacity:
            victim = self._victim(tier, protect, scope, octets)
            if victim is None:
                raise CapacityExhausted(f"tier {tier} has no room left that is not leased")
            self._demote_or_drop(victim, tier, protect)

    def _victim(self, tier: Tier, protect: set[BlockId], scope: str, octets: int) -> BlockId | None:
        """The next block to move out of ``tier`` for ``octets`` more of ``scope``: from the
        scope that would hold most of it (every scope's fair share of a tier is the same, so
        that scope is the furthest over its share; on a tie the one asking: one tenant's flood
        takes its own blocks first, never another's share), then lowest priority, then least
        recently used."""
        used = self._scope_used[tier]

        def after(s: str) -> tuple[int, bool]:
            return used[s] + (octets if s == scope else 0), s == scope

        for candidate in sorted(used, key=after, reverse=True):
            found = self._victim_in(tier, candidate, protect)
            if found is not None:
                return found
        return None

    def _victim_in(self, tier: Tier, scope: str, protect: set[BlockId]) -> BlockId | None:
        """The first block of ``scope``'s eviction order in ``tier`` that may go. Leased blocks
        met on the way are set aside until a lease ends, so each eviction pops past them once
        at most, not every time."""
        order = self._order[tier].get(scope, [])
        ended = self._leases.ended()
        seen, parked = self._parked[tier].pop(scope, (ended, []))
        if seen != ended:  # a lease ended: the blocks it held may go again
            for item in parked:
                heapq.heappush(order, item)
            parked = []
        passed = []
        found = None
        while order:
            priority, tick, block = heapq.heappop(order)
            entry = self._blocks.get(block)
            if (
                entry is None
                or tier not in entry.spans
                or entry.tick != tick
                or self._effective_priority(entry) != priority
            ):
                continue  # stale
            if self._leases.leased(block):
                parked.append((priority, tick, block))
                continue
            passed.append((priority, tick, block))
            if block in protect:
                continue
            found = block
            break
        if found is None:  # a view's count may lag a lease that ended: look again
            held, parked = parked, []
            for item in held:
                (parked if self._leases.leased(item[2]) else passed).append(item)
            free = [item for item in passed if item[2] not in protect]
            found = min(free)[2] if free else None
        for item in passed:
            heapq.heappush(order, item)
        if parked:
            self._parked[tier][scope] = (ended, parked)
        return found

    def _make_scope_room(self, scope: str, octets: int, protect: set[BlockId]) -> None:
        """Keep ``scope`` within its stored-octets quota with ``octets`` more: its own blocks
        go first (slowest tier first, then as ``_victim_in`` orders them). Refused with
        ``CapacityExhausted`` naming the quota, before anything is dropped, when even all of
        its blocks that may go would not make the room."""
        limit = self.quotas.of(scope).stored_octets
        if limit is None or self._scope_total[scope] + octets <= limit:
            return
        kept = sum(
            self._octets(t, e.meta, span)
            for b, e in itertools.chain(self._blocks.items(), self._faulted.items())
            if b[1] == scope and (b in protect or b in self._faulted or self._leases.leased(b))
            for t, span in e.spans.items()
        )
        if kept + octets > limit:
            raise CapacityExhausted(
                f"scope {scope} is at its stored-octets quota of {limit} here "
                f"({self._scope_total[scope]} held, {kept} of it leased or in use)"
            )
        while self._scope_total[scope] + octets > limit:
            victim = next(
                v
                for tier in reversed([t.name for t in self._tiers])
                if (v := self._victim_in(tier, scope, protect)) is not None
            )
            self.stats.evictions["quota"] = self.stats.evictions.get("quota", 0) + 1
            self.drop(victim)

    def _demote_or_drop(self, block: BlockId, tier: Tier, protect: set[BlockId]) -> None:
        entry = self._blocks[block]
        lower = self._below(tier)
        if lower is not None and self._fits_below(entry, tier, lower):
            self._demote(block, entry, tier, lower, protect)
        else:
            self.stats.evictions[tier] = self.stats.evictions.get(tier, 0) + 1
            self.drop(block)

    def _below(self, tier: Tier) -> Tier | None:
        names = [t.name for t in self._tiers]
        i = names.index(tier) + 1
        return names[i] if i < len(names) else None

    def _fits_below(self, entry: _Block, tier: Tier, lower: Tier) -> bool:
        octets = self._octets(lower, entry.meta, self._merged(entry, tier, lower))
        return octets <= self._room(lower, octets)

    @staticmethod
    def _merged(entry: _Block, tier: Tier, lower: Tier) -> Span:
        """The span ``lower`` holds once ``tier``'s layers moved down into it."""
        span, below = entry.spans[tier], entry.spans.get(lower)
        return span if below is None else (span[0], below[1])

    def _demote(
        self, block: BlockId, entry: _Block, tier: Tier, lower: Tier, protect: set[BlockId]
    ) -> None:
        added = self._octets(lower, entry.meta, self._merged(entry, tier, lower))
        added -= self._lower_octets(entry, lower)
        self._make_room(lower, added, protect | {block}, block[1])
        self._move(block, entry, tier, lower)
        self.stats.demotions[tier] = self.stats.demotions.get(tier, 0) + 1
        self._published(block, entry)

    # -- explicit moves (KvHints) --------------------------------------------------------------

    def demote(self, block: BlockId) -> bool:
        """Move the block's layers in the fastest tier to the next one (a valid copy there
        first, then the fast copy freed); False if it has none there. ``CapacityExhausted``
        (nothing changed) when the next tier has no room that is not protected."""
        entry = self._entry(block)
        top = self._tiers[0].name
        lower = self._below(top)
        if top not in entry.spans or lower is None:
            return False
        if not self._fits_below(entry, top, lower):
            raise CapacityExhausted(f"tier {lower} has no room that is not protected")
        self._demote(block, entry, top, lower, set())
        return True

    def promote(self, block: BlockId, last: int | None = None) -> bool:
        """Move layers ``0..last`` (default: all) into the fastest tier, making room there as
        for a new block; False if they are there already. ``CapacityExhausted`` (nothing
        changed) when that tier has no room that is not protected; ``ValueError`` when it
        cannot keep such layers."""
        entry = self._entry(block)
        meta = entry.meta
        top = self._tiers[0].name
        hi = meta.layer_count - 1 if last is None else last
        current = entry.spans.get(top)
        if current is not None and current[1] >= hi:
            return False
        if not self._data[top].accepts(meta, (0, hi)):
            raise ValueError(f"tier {top} cannot keep layers 0-{hi} of this block")
        wanted = self._octets(top, meta, (0, hi))
        if self._protected_octets(top, block) + wanted > self._spec[top].capacity:
            raise CapacityExhausted(f"tier {top} has no room that is not protected")
        try:
            held = [
                (tier, span, self._data[tier].read(block, meta, span, span))
                for tier, span in self._in_tier_order(entry)
            ]
        except DigestError as exc:
            self.stats.digest_failures += 1
            self.drop(block)
            raise NotFound(f"{block_ref(block)} failed verification and was dropped") from exc
        before = self._octets(top, meta, current) if current else 0
        self._make_room(top, wanted - before, {block}, block[1])
        up: list[memoryview] = []
        for tier, (a, b), data in held:
            base = meta.offsets[a]
            cut = meta.offsets[min(b, hi) + 1] - base
            up.append(data[:cut])
            if tier == top:
                continue
            self._charge(tier, block, -self._octets(tier, meta, (a, b)))
            if b > hi:  # this tier keeps the layers above ``hi``
                self._data[tier].write(block, meta, (hi + 1, b), (data[cut:],))
                entry.spans[tier] = (hi + 1, b)
                self._charge(tier, block, self._octets(tier, meta, (hi + 1, b)))
            else:
                self._data[tier].delete(block)
                del entry.spans[tier]
        self._data[top].write(block, meta, (0, hi), up)
        self._charge(top, block, wanted - before)
        entry.spans[top] = (0, hi)
        self._touch(block, entry)
        self._published(block, entry)
        return True

    def _lower_octets(self, entry: _Block, lower: Tier) -> int:
        span = entry.spans.get(lower)
        return 0 if span is None else self._octets(lower, entry.meta, span)

    def _move(self, block: BlockId, entry: _Block, tier: Tier, lower: Tier) -> None:
        meta = entry.meta
        span = entry.spans[tier]
        removed, lower_before = self._octets(tier, meta, span), self._lower_octets(entry, lower)
        parts = [self._data[tier].read(block, meta, span, span)]
        merged = span
        below = entry.spans.get(lower)
        if below is not None:
            parts.append(self._data[lower].read(block, meta, below, below))
            merged = (span[0], below[1])
        self._data[lower].write(block, meta, merged, parts)
        self._data[tier].delete(block)
        del entry.spans[tier]
        entry.spans[lower] = merged
        self._charge(tier, block, -removed)
        self._charge(lower, block, self._octets(lower, meta, merged) - lower_before)
        self._push(lower, block, entry)

    def _entry(self, block: BlockId) -> _Block:
        entry = self._blocks.get(block)
        if entry is None:
            raise NotFound(f"{block_ref(block)} is not held here")
        return entry

    # -- dropping ------------------------------------------------------------------------------

    def drop(self, block: BlockId) -> bool:
        """Withdraw and remove a block from every tier, leased or not; False if not held."""
        entry = self._blocks.get(block)
        if entry is None:
            return False
        self._effects.append(Withdraw(self._ref(block)))
        self._forget(block, entry)
        return True

    def _ref(self, block: BlockId) -> ReplicaRef:
        compat, scope, key = block
        return ReplicaRef.model_construct(
            compat_id=compat, scope_id=scope, block_key=key, holder=self.holder_url
        )

    def _fault(self, block: BlockId, entry: _Block) -> None:
        """KVSP 6.6: a holder that must evict leased data due to a fault first withdraws it.
        The block leaves every query now; its octets go once the withdrawal is delivered."""
        self._unlist(block)
        self._faulted[block] = entry
        self._effects.append(Withdraw(self._ref(block), then_forget=True))

    def forget_withdrawn(self, blocks: Iterable[BlockId]) -> None:
        """The withdrawals of these faulty blocks reached the Index Service (or there is
        none): their octets go."""
        for block in blocks:
            entry = self._faulted.pop(block, None)
            if entry is not None:
                self._free(block, entry)

    def _add(self, block: BlockId, entry: _Block) -> None:
        self._blocks[block] = entry
        self._by_key[block[2]] = block

    def _forget(self, block: BlockId, entry: _Block) -> None:
        self._free(block, entry)
        self._unlist(block)

    def _unlist(self, block: BlockId) -> None:
        """``block`` leaves every query and schedule (its octets are ``_free``'s business)."""
        del self._blocks[block]
        del self._by_key[block[2]]
        self._refresh.discard(block)
        self._priority_ends.discard(block)

    def _free(self, block: BlockId, entry: _Block) -> None:
        for tier, span in entry.spans.items():
            self._data[tier].delete(block)
            self._charge(tier, block, -self._octets(tier, entry.meta, span))
        entry.spans.clear()

    # -- records -------------------------------------------------------------------------------

    def _record(self, block: BlockId, entry: _Block) -> ReplicaRecord:
        meta = entry.meta
        compat, scope, key = block
        residency = []
        for tier, span in self._in_tier_order(entry):
            part = self._residencies.get((tier, span))
            if part is None:  # one per tier and range: records are rebuilt on every move
                rate = self._spec[tier].read_mbit_per_s
                part = Residency.model_construct(tier=tier, layers=span, read_mbit_per_s=rate)
                self._residencies[(tier, span)] = part
            residency.append(part)
        # a copy of one template with the block's members: cheaper than building each record
        return self._template.model_copy(
            update={
                "block_key": key,
                "compat_id": compat,
                "scope_id": scope,
                "codec": meta.codec,
                "size": meta.size,
                "digest": meta.digest_text,
                "layer_digests": meta.layer_digests_hex,
                "residency": tuple(residency),
            }
        )

    def _published(self, block: BlockId, entry: _Block) -> ReplicaRecord:
        record = self._record(block, entry)
        entry.published_at = self.clock.now_ms()
        self._refresh.set(block, entry.published_at + self.refresh_after_ms)
        self._effects.append(Publish(record))
        return record

    def refresh_due(self) -> int:
        """Republish every record past half its TTL; returns how many."""
        count = 0
        for block in self._refresh.due(self.clock.now_ms()):
            entry = self._blocks.get(block)
            if entry is not None:
                self._published(block, entry)
                count += 1
        return count

    def granted(self, ttl_ms: int) -> None:
        """The Index Service granted records ``ttl_ms`` (it may cap what they ask for): from
        now on they are published again at half of it, so none expires while held."""
        after = max(1, ttl_ms // 2)
        if after >= self.refresh_after_ms:
            return
        self.refresh_after_ms = after
        for block, entry in self._blocks.items():
            self._refresh.set(block, entry.published_at + after)

    def volatile(self) -> list[BlockId]:
        """Blocks with no copy on disk: a holder that stops no longer has them."""
        return [b for b, entry in self._blocks.items() if "disk" not in entry.spans]
