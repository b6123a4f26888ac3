"""Sequence-sharded caches and resharding (KVSP 6.9), pure.

``plan_reshard`` turns Shard Map v and v+1 into one plan per member (every instance in either
version): token ranges an instance holds in both versions are ``retain`` and never transferred;
ranges it gains are ``fetch``, split by the instance that holds them in version v (ranges beyond
version v's tokens have no holder: they are computed, not fetched); ranges it gives up are
``release``. ``ReshardCoordinator`` keeps version v authoritative until every member has
acknowledged its plan, then commits v+1; a member that does not acknowledge by the deadline, or
fails, aborts the change and v stays. ``propose`` generates v+1 for common moves (grow, shrink,
rebalance) and keeps the one that transfers the fewest tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvsp.core.clock import Clock
from kvsp.core.problems import IllegalTransition, InvalidInput, NotFound
from kvsp.core.records import FetchRange, ReshardPlan, Shard, ShardMap
from kvsp.core.urls import canonical_url

__all__ = [
    "ReshardCoordinator",
    "ReshardResult",
    "even_map",
    "plan_reshard",
    "propose",
    "transferred_tokens",
]

Range = tuple[int, int]


def _owned(shard_map: ShardMap) -> dict[str, list[Range]]:
    owned: dict[str, list[Range]] = {}
    for shard in shard_map.shards:
        owned.setdefault(canonical_url(shard.instance), []).append(shard.tokens)
    return owned


def _intersect(a: Range, b: Range) -> Range | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


def _subtract(ranges: Iterable[Range], minus: Sequence[Range]) -> list[Range]:
    out = []
    for start, end in ranges:
        pieces = [(start, end)]
        for m in minus:
            next_pieces = []
            for lo, hi in pieces:
                if m[1] <= lo or m[0] >= hi:
                    next_pieces.append((lo, hi))
                    continue
                if lo < m[0]:
                    next_pieces.append((lo, m[0]))
                if m[1] < hi:
                    next_pieces.append((m[1], hi))
            pieces = next_pieces
        out.extend(pieces)
    return sorted(out)


def _merge(ranges: Iterable[Range]) -> list[Range]:
    merged: list[Range] = []
    for lo, hi in sorted(ranges):
        if merged and merged[-1][1] == lo:
            merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    return merged


def plan_reshard(old: ShardMap, new: ShardMap, deadline_ms: int) -> dict[str, ReshardPlan]:
    """One plan per member, keyed by canonical instance URL (see module doc)."""
    if new.map != old.map:
        raise InvalidInput(f"map {new.map} is not map {old.map}")
    if new.version != old.version + 1:
        raise InvalidInput(f"a reshard moves version {old.version} to {old.version + 1}")
    before, after = _owned(old), _owned(new)
    plans = {}
    for instance in sorted(set(before) | set(after)):
        had, gets = before.get(instance, []), after.get(instance, [])
        retain = _merge(r for a in had for b in gets if (r := _intersect(a, b)) is not None)
        fetch = []
        for piece in _subtract(gets, had):
            for shard in old.shards:
                overlap = _intersect(piece, shard.tokens)
                if overlap is not None:
                    fetch.append(
                        FetchRange.model_validate({"tokens": overlap, "from": shard.instance})
                    )
        plans[instance] = ReshardPlan.model_validate(
            {
                "map": old.map,
                "from": old.version,
                "to": new.version,
                "deadline_ms": deadline_ms,
                "retain": retain,
                "fetch": fetch,
                "release": _merge(_subtract(had, gets)),
            }
        )
    return plans


def transferred_tokens(plans: dict[str, ReshardPlan]) -> int:
    return sum(f.tokens[1] - f.tokens[0] for plan in plans.values() for f in plan.fetch)


def even_map(map_id: str, version: int, instances: Sequence[str], total_tokens: int) -> ShardMap:
    """``total_tokens`` split into contiguous, nearly equal shares, in ``instances`` order."""
    if not instances or total_tokens < len(instances):
        raise InvalidInput("each instance needs at least one token")
    n = len(instances)
    bounds = [total_tokens * i // n for i in range(n + 1)]
    return ShardMap(
        map=map_id,
        version=version,
        shards=tuple(
            Shard(tokens=(bounds[i], bounds[i + 1]), instance=instances[i]) for i in range(n)
        ),
    )


def propose(
    current: ShardMap, instances: Sequence[str], total_tokens: int | None = None
) -> ShardMap:
    """Version v+1 over ``instances`` with even shares (of ``total_tokens``, default: the
    current map's), choosing where each new instance goes so that the fewest tokens move:
    instances that stay keep their order, each newcomer is tried at every position."""
    total = total_tokens if total_tokens is not None else current.shards[-1].tokens[1]
    wanted = [canonical_url(i) for i in instances]
    if len(set(wanted)) != len(wanted):
        raise InvalidInput("an instance can appear once in a proposal")
    seen: dict[str, None] = {}
    for shard in current.shards:
        seen.setdefault(canonical_url(shard.instance), None)
    order = [i for i in seen if i in wanted]
    version = current.version + 1

    def cost(candidate: list[str]) -> int:
        proposal = even_map(current.map, version, candidate, total)
        return transferred_tokens(plan_reshard(current, proposal, 1))

    for newcomer in (i for i in wanted if i not in seen):
        options = [[*order[:k], newcomer, *order[k:]] for k in range(len(order) + 1)]
        order = min(options, key=cost)
    return even_map(current.map, version, order, total)


@dataclass(frozen=True, slots=True)
class ReshardResult:
    """What to send to every member: ``commit`` (True) or abort (False) of ``version``."""

    map: str
    version: int
    commit: bool
    members: tuple[str, ...]
    reason: str = ""


@dataclass(slots=True)
class _InFlight:
    target: ShardMap
    plans: dict[str, ReshardPlan]
    deadline: int
    acked: set[str] = field(default_factory=set)


class ReshardCoordinator:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._current: dict[str, ShardMap] = {}
        self._flight: dict[str, _InFlight] = {}

    def current(self, map_id: str) -> ShardMap:
        found = self._current.get(map_id)
        if found is None:
            raise NotFound(f"no shard map {map_id}")
        return found

    def in_flight(self, map_id: str) -> int | None:
        flight = self._flight.get(map_id)
        return None if flight is None else flight.target.version

    def restore(self, maps: Sequence[ShardMap]) -> None:
        """Replace every map with ``maps`` (a new leader's load); nothing is in flight: a new
        leader aborts what its predecessor had begun."""
        self._current = {m.map: m for m in maps}
        self._flight.clear()

    def register(self, shard_map: ShardMap) -> None:
        """Adopt a first map (a new sharded context)."""
        if shard_map.map in self._current:
            raise IllegalTransition(f"map {shard_map.map} exists; change it with a reshard")
        self._current[shard_map.map] = shard_map

    def begin(self, target: ShardMap, deadline_ms: int) -> dict[str, ReshardPlan]:
        """Start moving to ``target`` (version v+1); returns the plan for every member."""
        current = self.current(target.map)
        if target.map in self._flight:
            raise IllegalTransition(f"map {target.map} is already moving to a new version")
        plans = plan_reshard(current, target, deadline_ms)
        self._flight[target.map] = _InFlight(target, plans, self.clock.now_ms() + deadline_ms)
        return plans

    def acknowledge(self, map_id: str, instance: str, version: int) -> ReshardResult | None:
        """A member loaded its fetches; returns the commit once every member has (or the
        abort, when the acknowledgement comes after the deadline)."""
        flight = self._flight.get(map_id)
        if flight is None or flight.target.version != version:
            raise IllegalTransition(f"no reshard of map {map_id} to version {version} in flight")
        url = canonical_url(instance)
        if url not in flight.plans:
            raise IllegalTransition(f"{instance} is not a member of this reshard")
        if self.clock.now_ms() >= flight.deadline:
            return self.abort(map_id, "deadline passed")
        flight.acked.add(url)
        if flight.acked != set(flight.plans):
            return None
        del self._flight[map_id]
        self._current[map_id] = flight.target
        return ReshardResult(map_id, version, True, tuple(flight.plans))

    def abort(self, map_id: str, reason: str) -> ReshardResult | None:
        flight = self._flight.pop(map_id, None)
        if flight is None:
            return None
        return ReshardResult(map_id, flight.target.version, False, tuple(flight.plans), reason)

    def member_failed(self, instance: str) -> list[ReshardResult]:
        """A member that failed can no longer acknowledge: abort every reshard it is in."""
        url = canonical_url(instance)
        hit = [m for m, f in self._flight.items() if url in f.plans and url not in f.acked]
        return [r for m in hit if (r := self.abort(m, f"{url} failed")) is not None]

    def expire(self) -> list[ReshardResult]:
        """Abort every reshard whose deadline passed without every acknowledgement."""
        now = self.clock.now_ms()
        late = [m for m, f in self._flight.items() if f.deadline <= now]
        return [r for m in late if (r := self.abort(m, "deadline passed")) is not None]
