"""KvHints at an instance, pure: pins, and the execution of the local actions (retain, pin,
demote, prefetch) against the pool, each answered with an outcome (the vocabulary is
``kvsp.core.hints``).

Semantics (all bounded, nothing a hint says can pin memory without bound or block a request):

- Retain raises the blocks' eviction priority until a deadline (clipped to ``max_retain_ms`` and
  ``max_priority``); they stay evictable.
- Pin protects the blocks from ordinary eviction until a deadline (clipped to ``max_pin_ms``),
  within a per-session and a total octet limit; with ``"tier": "g2"`` the blocks are demoted
  first, so the pin holds G2 and leaves G1 free.
- Demote makes sure a G2 copy exists, then frees the G1 pages (the store writes the copy before
  it frees anything).
- Prefetch promotes G2 -> G1 (a no-op for blocks already there); with a ``destination`` it is
  a Share to the instance that will serve the session.
- Share (I/O, executed by the service) copies the blocks to another instance or holder.

Where the engine keeps its own pages apart from the pool (vLLM's G1: it evicts them by its own
order and loads them only for a request), the pool is G2 alone. There, retain, pin and demote
act on the pool's copies and report the blocks that are also in the engine's pages with code
``engine-g1`` (their pages stay, or go, as the engine decides); prefetch counts the blocks
already in the engine's pages and reports the rest (in G2, loaded once a request uses them)
with the same code. A block only in the engine's pages has no copy these actions can act on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass

from kvsp.core.clock import Clock
from kvsp.core.deadlines import Deadlines
from kvsp.core.hints import HintAction, HintOutcome, HintPayload, Outcome, Reason
from kvsp.core.problems import CapacityExhausted
from kvsp.holder.blocks import BlockId
from kvsp.holder.store import BlockStore
from kvsp.quotas import Quotas

__all__ = [
    "HintLimits",
    "LocalHints",
    "PinTable",
    "engine_kept",
    "engine_prefetch",
    "held_first",
]


@dataclass(frozen=True)
class HintLimits:
    max_retain_ms: int = 600_000
    max_priority: int = 100
    max_pin_ms: int = 300_000
    #: octets one session may keep pinned, and all sessions together
    pin_session_bytes: int = 64 << 20
    pin_total_bytes: int = 256 << 20
    #: octets one scope (tenant) may keep pinned where the quotas set none; None: an equal
    #: share of ``pin_total_bytes`` among the tenants
    pin_scope_bytes: int | None = None


@dataclass(slots=True)
class _Pin:
    octets: int
    #: each owner's deadline (ms); the block stays pinned until the last one
    owners: dict[str, int]
    #: the owner whose limits the octets count against (another one when it lets go)
    charged: str


class PinTable:
    """Pinned blocks until their deadlines, within octet limits (a ``LeaseView`` for the store).

    A block several sessions pin (a shared system prompt) stays pinned until the last of them
    lets go or expires; its octets count once, against one owner at a time, and against its
    scope, whose quota (``pinned_octets``, default ``pin_scope_bytes``) keeps one tenant from
    taking the whole budget. Expiry costs O(expired): deadlines sit in a heap."""

    def __init__(
        self, clock: Clock, limits: HintLimits, quotas: Quotas | None = None, tenants: int = 1
    ) -> None:
        self.clock = clock
        self.limits = limits
        self.quotas = quotas or Quotas()
        self._scope_default = (
            limits.pin_scope_bytes
            if limits.pin_scope_bytes is not None
            else limits.pin_total_bytes // max(1, tenants)
        )
        self._pins: dict[BlockId, _Pin] = {}
        #: when each owner's pin of each block ends
        self._ends: Deadlines[tuple[BlockId, str]] = Deadlines()
        self._octets: Counter[str] = Counter()
        self._scopes: Counter[str] = Counter()
        self._ended = 0

    @property
    def octets(self) -> int:
        return sum(self._octets.values())

    def octets_of(self, owner: str) -> int:
        return self._octets[owner]

    def until(self, block: BlockId) -> int | None:
        pin = self._pins.get(block)
        if pin is None:
            return None
        last = max(pin.owners.values())
        return last if last > self.clock.now_ms() else None

    def leased(self, block: BlockId) -> bool:
        return self.until(block) is not None

    def leased_blocks(self) -> Iterable[BlockId]:
        return [b for b in self._pins if self.until(b) is not None]

    def leased_count(self) -> int:
        return len(self._pins)  # expired pins not yet let go included: an upper bound

    def ended(self) -> int:
        self.expire()
        return self._ended

    def expire(self) -> list[BlockId]:
        """Let go of every pin past its deadline; the blocks no longer pinned at all."""
        ended = self._ends.due(self.clock.now_ms())
        return [block for block, owner in ended if self._let_go(block, owner)]

    def _let_go(self, block: BlockId, owner: str) -> bool:
        """``owner`` no longer pins ``block``; True if nobody does any more."""
        pin = self._pins[block]
        del pin.owners[owner]
        self._ends.discard((block, owner))
        if pin.charged == owner:
            self._charge(owner, -pin.octets)
            if pin.owners:
                pin.charged = next(iter(pin.owners))
                self._charge(pin.charged, pin.octets)
        if pin.owners:
            return False
        del self._pins[block]
        self._ended += 1
        self._scopes[block[1]] -= pin.octets
        if self._scopes[block[1]] <= 0:
            del self._scopes[block[1]]
        return True

    def octets_by_scope(self) -> dict[str, int]:
        return dict(self._scopes)

    def _charge(self, owner: str, octets: int) -> None:
        self._octets[owner] += octets
        if self._octets[owner] <= 0:
            del self._octets[owner]

    def pin(
        self, owner: str, blocks: Sequence[tuple[BlockId, int]], until_ms: int
    ) -> list[BlockId]:
        """Pin blocks (with their octets) in order until ``until_ms`` while the limits allow;
        the blocks pinned. A block pinned already (by anyone) costs nothing more."""
        self.expire()
        done = []
        total = self.octets
        for block, octets in blocks:
            pin = self._pins.get(block)
            if pin is None:
                scope = block[1]
                if (
                    self._octets[owner] + octets > self.limits.pin_session_bytes
                    or total + octets > self.limits.pin_total_bytes
                    or self._scopes[scope] + octets
                    > self.quotas.limit(scope, "pinned_octets", self._scope_default)
                ):
                    break
                pin = self._pins[block] = _Pin(octets, {}, owner)
                self._charge(owner, octets)
                self._scopes[scope] += octets
                total += octets
            if until_ms > pin.owners.get(owner, 0):
                pin.owners[owner] = until_ms
                self._ends.set((block, owner), until_ms)
            done.append(block)
        return done

    def release(self, owner: str) -> int:
        """Drop every pin ``owner`` holds (a session ended); how many."""
        mine = [b for b, p in self._pins.items() if owner in p.owners]
        for block in mine:
            self._let_go(block, owner)
        return len(mine)


class LocalHints:
    """Retain, Pin, Demote and Prefetch on this instance's pool. Runs on the store's thread."""

    def __init__(
        self, store: BlockStore, pins: PinTable, limits: HintLimits, g1_layers: int | None
    ) -> None:
        self.store = store
        self.pins = pins
        self.limits = limits
        self.clock = store.clock
        #: layers a promotion brings into G1 (None: all)
        self.g1_last = None if g1_layers is None else g1_layers - 1

    def prepare(
        self, action: HintAction, payload: HintPayload, blocks: Sequence[BlockId]
    ) -> tuple[HintOutcome, list[BlockId]]:
        return held_first(action, payload, blocks, self.store)

    def run(
        self,
        action: str,
        outcome: HintOutcome,
        blocks: Sequence[BlockId],
        payload: HintPayload,
        owner: str,
    ) -> HintOutcome:
        """Carry out ``action`` on ``blocks`` (already resolved and held here), filling in and
        returning ``outcome`` (which may already list missing blocks)."""
        if action == "retain":
            return self._retain(outcome, blocks, payload)
        if action == "pin":
            return self._pin(outcome, blocks, payload, owner)
        move = self.store.demote if action == "demote" else self._promote
        for block in blocks:
            if block not in self.store:  # room made for an earlier one dropped it
                outcome.missing.append(block[2])
                dropped = "a target block was dropped to make room for another"
                outcome.note("clipped", Reason.NOT_HELD, dropped)
                continue
            try:
                move(block)
            except CapacityExhausted as exc:
                said: Outcome = "deferred" if not outcome.blocks else "clipped"
                outcome.note(said, Reason.NO_ROOM, exc.detail)
                return outcome
            outcome.blocks += 1
        return outcome

    def _promote(self, block: BlockId) -> bool:
        return self.store.promote(block, self.g1_last)

    def _retain(
        self, outcome: HintOutcome, blocks: Sequence[BlockId], payload: HintPayload
    ) -> HintOutcome:
        ttl = payload.ttl_ms or self.limits.max_retain_ms
        priority = 1 if payload.priority is None else payload.priority
        granted_ttl = min(ttl, self.limits.max_retain_ms)
        granted_priority = min(priority, self.limits.max_priority)
        if (granted_ttl, granted_priority) != (ttl, priority):
            above = "TTL or priority above this instance's limits"
            outcome.note("clipped", Reason.OVER_LIMITS, above)
        until = self.clock.now_ms() + granted_ttl
        for block in blocks:
            self.store.retain(block, granted_priority, until)
        outcome.blocks = len(blocks)
        outcome.ttl_ms, outcome.priority = granted_ttl, granted_priority
        return outcome

    def _pin(
        self, outcome: HintOutcome, blocks: Sequence[BlockId], payload: HintPayload, owner: str
    ) -> HintOutcome:
        if payload.ttl_ms is None:
            outcome.note("rejected", Reason.INVALID, "a pin needs ttl_ms")
            return outcome
        granted = min(payload.ttl_ms, self.limits.max_pin_ms)
        if granted < payload.ttl_ms:
            outcome.note("clipped", Reason.OVER_LIMITS, f"TTL clipped to {granted} ms")
        if payload.tier == "g2":
            for block in blocks:
                if block not in self.store:  # room made for an earlier one dropped it
                    continue
                try:
                    self.store.demote(block)
                except CapacityExhausted as exc:
                    outcome.note("deferred", Reason.NO_ROOM, exc.detail)
                    return outcome
            blocks = [b for b in blocks if b in self.store]
        sized = [(b, self.store.meta(b).size) for b in blocks]
        pinned = self.pins.pin(owner, sized, self.clock.now_ms() + granted)
        outcome.blocks, outcome.ttl_ms = len(pinned), granted
        if not pinned and blocks:
            outcome.note("rejected", Reason.PIN_LIMIT, "pin limits reached")
        elif len(pinned) < len(blocks):
            after = f"pin limits reached after {len(pinned)} of {len(blocks)} blocks"
            outcome.note("clipped", Reason.PIN_LIMIT, after)
        return outcome


_ENGINE_KEEPS = {
    "retain": "stay in the engine's pages under its own eviction order; kvsp's copies are retained",
    "pin": "stay in the engine's pages under its own eviction order; kvsp's copies are pinned",
    "demote": "stay in the engine's pages until it evicts them",
}


def engine_kept(action: str, outcome: HintOutcome, in_g1: frozenset[BlockId]) -> HintOutcome:
    """Retain, pin or demote where the engine keeps its own pages: say which target blocks
    (``in_g1``) the action did not reach there. A block only in those pages was listed as
    missing by the pool; it is held, just not by a copy the action can act on."""
    if not in_g1 or outcome.outcome in ("deferred", "rejected"):
        return outcome
    g1_keys = {b[2] for b in in_g1}
    outcome.missing = [k for k in outcome.missing if k not in g1_keys]
    if outcome.outcome == "clipped" and outcome.code != Reason.NOT_HELD:
        return outcome  # a limit cut it, which says more
    said: Outcome = "clipped" if outcome.blocks else "rejected"
    outcome.note(said, Reason.ENGINE_G1, f"{len(in_g1)} target blocks {_ENGINE_KEEPS[action]}")
    return outcome


def engine_prefetch(
    action: HintAction,
    blocks: Sequence[BlockId],
    in_g1: frozenset[BlockId],
    in_g2: Container[BlockId],
) -> HintOutcome:
    """Prefetch where the engine loads its own pages: the targets already there (``in_g1``)
    are done; those only in G2 (``in_g2``) wait for a request to use them."""
    outcome = HintOutcome(action.action_id, action.action_type, "accepted", blocks=len(in_g1))
    only_g2 = [b for b in blocks if b not in in_g1 and b in in_g2]
    outcome.missing = [b[2] for b in blocks if b not in in_g1 and b not in in_g2]
    if only_g2:
        said: Outcome = "clipped" if in_g1 else "rejected"
        later = f"{len(only_g2)} target blocks are in G2 only; the engine loads them into "
        outcome.note(said, Reason.ENGINE_G1, later + "its pages when a request uses them")
    elif not in_g1:
        outcome.note("missing", Reason.NOT_HELD, "no target block is held here")
    elif outcome.missing:
        missing = len(outcome.missing)
        outcome.note("clipped", Reason.NOT_HELD, f"{missing} target blocks are not held here")
    return outcome


def held_first(
    action: HintAction, payload: HintPayload, blocks: Sequence[BlockId], held: Container[BlockId]
) -> tuple[HintOutcome, list[BlockId]]:
    """The outcome so far and the blocks to act on: those of ``blocks`` in ``held``, root
    first, cut at ``limit_blocks``; the others are listed as missing (``missing`` when none is
    held)."""
    outcome = HintOutcome(action.action_id, action.action_type, "accepted")
    found = [b for b in blocks if b in held]
    outcome.missing = [b[2] for b in blocks if b not in held]
    if not found:
        outcome.note("missing", Reason.NOT_HELD, "no target block is held here")
        return outcome, []
    if outcome.missing:
        missing = len(outcome.missing)
        outcome.note("clipped", Reason.NOT_HELD, f"{missing} target blocks are not held here")
    if payload.limit_blocks is not None and len(found) > payload.limit_blocks:
        found = found[: payload.limit_blocks]
        limit = payload.limit_blocks
        outcome.note("clipped", Reason.LIMIT_BLOCKS, f"limited to {limit} blocks")
    return outcome, found
