"""The instance's paged KV pool, pure: which blocks it holds, in which tier, who uses them, and
which go first when room is needed (vLLM's block pool is the model).

Blocks of ``block_tokens`` tokens are named by Block Key. G1 is the engine's working memory and
G2 host memory, each with a capacity in blocks; a block may be in either or both. A block that a
running request uses has a reference count above zero and is never evicted; blocks nobody uses
sit in one free list per tier, least recently released first, so choosing a victim, releasing and
touching are O(1) (ordered dicts). Admitting a block into a full G1 first demotes G1's victim to
G2 (unless G2 already has it); a full G2 drops its victim. Every drop from the last tier is an
``Evicted`` event (the adapter withdraws the record first, then frees the memory), every block
that becomes held an ``Admitted`` event (the adapter publishes it): drained with ``take_events``.

``longest_prefix`` says how many leading keys of a request are held, and where; a request reuses
those from G1, then G2, and only then asks remote holders. Payloads (tensors, containers) live in
the adapter, keyed the same way: the pool decides, the adapter moves octets.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvsp.core.problems import CapacityExhausted, ConfigurationError

__all__ = ["Admitted", "Demoted", "Evicted", "KvPool", "PoolEvent", "Prefix"]

PoolTier = Literal["g1", "g2"]


@dataclass(frozen=True, slots=True)
class Admitted:
    key: str
    tier: PoolTier


@dataclass(frozen=True, slots=True)
class Demoted:
    """The block's octets must be copied from G1 to G2 before G1 frees them."""

    key: str


@dataclass(frozen=True, slots=True)
class Evicted:
    key: str
    tier: PoolTier
    #: no tier holds the block any more: its Replica Record must be withdrawn
    gone: bool


PoolEvent = Admitted | Demoted | Evicted


@dataclass(frozen=True, slots=True)
class Prefix:
    """How many leading keys are held: ``g1`` of them in G1 (a prefix), then ``g2`` more that
    are in G2 (some of which may also be in G1)."""

    g1: int
    g2: int

    @property
    def total(self) -> int:
        return self.g1 + self.g2


@dataclass(slots=True)
class _Block:
    key: str
    in_g1: bool = False
    in_g2: bool = False
    refs: int = 0


class KvPool:
    def __init__(self, g1_blocks: int, g2_blocks: int) -> None:
        if g1_blocks < 1 or g2_blocks < 0:
            raise ConfigurationError("G1 needs at least one block; G2 may be empty")
        self.capacity: dict[PoolTier, int] = {"g1": g1_blocks, "g2": g2_blocks}
        self._blocks: dict[str, _Block] = {}
        self._count: dict[PoolTier, int] = {"g1": 0, "g2": 0}
        #: per tier, blocks nobody uses, least recently released first
        self._free: dict[PoolTier, OrderedDict[str, None]] = {
            "g1": OrderedDict(),
            "g2": OrderedDict(),
        }
        self._events: list[PoolEvent] = []

    # -- queries -------------------------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def tiers(self, key: str) -> tuple[PoolTier, ...]:
        block = self._blocks.get(key)
        if block is None:
            return ()
        held: list[PoolTier] = []
        if block.in_g1:
            held.append("g1")
        if block.in_g2:
            held.append("g2")
        return tuple(held)

    def refs(self, key: str) -> int:
        block = self._blocks.get(key)
        return 0 if block is None else block.refs

    def used(self, tier: PoolTier) -> int:
        return self._count[tier]

    def eviction_order(self, tier: PoolTier) -> list[str]:
        """The blocks of ``tier`` nobody uses, first victim first."""
        return list(self._free[tier])

    def longest_prefix(self, keys: Sequence[str]) -> Prefix:
        g1 = 0
        while g1 < len(keys) and (b := self._blocks.get(keys[g1])) is not None and b.in_g1:
            g1 += 1
        g2 = g1
        while g2 < len(keys) and (b := self._blocks.get(keys[g2])) is not None:
            g2 += 1
        return Prefix(g1, g2 - g1)

    def take_events(self) -> list[PoolEvent]:
        events, self._events = self._events, []
        return events

    # -- use -----------------------------------------------------------------------------------

    def acquire(self, keys: Sequence[str]) -> None:
        """A request uses these held blocks: none of them can be evicted until released."""
        missing = [k for k in keys if k not in self._blocks]
        if missing:
            raise KeyError(f"{len(missing)} blocks are not held, e.g. {missing[0]}")
        for key in keys:
            block = self._blocks[key]
            if block.refs == 0:
                for tier in self.tiers(key):
                    self._free[tier].pop(key, None)
            block.refs += 1

    def release(self, keys: Sequence[str]) -> None:
        """The request is done with these blocks; unused ones join the free lists (last)."""
        for key in keys:
            block = self._blocks[key]
            if block.refs <= 0:
                raise ValueError(f"block {key} is not in use")
            block.refs -= 1
            if block.refs == 0:
                for tier in self.tiers(key):
                    self._free[tier][key] = None

    # -- admission and eviction ----------------------------------------------------------------

    def admit(self, key: str, tier: PoolTier = "g1") -> None:
        """Hold ``key`` in ``tier`` (a completed block, or one loaded from elsewhere), making
        room first; the block starts unused. ``CapacityExhausted`` if every block of the tier
        is in use."""
        block = self._blocks.get(key)
        if block is not None and (block.in_g1 if tier == "g1" else block.in_g2):
            return
        self._make_room(tier, keep=key)
        if block is None:
            block = self._blocks[key] = _Block(key)
        if tier == "g1":
            block.in_g1 = True
        else:
            block.in_g2 = True
        self._count[tier] += 1
        if block.refs == 0:
            self._free[tier][key] = None
        self._events.append(Admitted(key, tier))

    def _make_room(self, tier: PoolTier, keep: str) -> None:
        if self._count[tier] < self.capacity[tier]:
            return
        free = self._free[tier]
        victim = next((k for k in free if k != keep), None)
        if victim is None:
            raise CapacityExhausted(f"every block of {tier} is in use")
        block = self._blocks[victim]
        if tier == "g1" and not block.in_g2 and self.capacity["g2"] > 0:
            self._events.append(Demoted(victim))
            self.admit(victim, "g2")  # may drop G2's own victim first
        self._drop(block, tier)

    def _drop(self, block: _Block, tier: PoolTier) -> None:
        self._free[tier].pop(block.key, None)
        if tier == "g1":
            block.in_g1 = False
        else:
            block.in_g2 = False
        self._count[tier] -= 1
        gone = not (block.in_g1 or block.in_g2)
        if gone:
            del self._blocks[block.key]
        self._events.append(Evicted(block.key, tier, gone))

    def free_g1(self, key: str) -> None:
        """Let G1 reclaim an unused block now (it stays in G2 if it is there)."""
        block = self._blocks.get(key)
        if block is None or not block.in_g1 or block.refs:
            return
        self._drop(block, "g1")
