"""The instance's part in sequence-sharded caches (KVSP 6.9), pure: which token ranges of which
shard map it holds, at which version, and what a reshard plan does to them.

KV is kept per token range as the octets of a KVB1 container's data for those tokens, one range
per entry: ``retain`` ranges stay exactly where they are (the same objects: nothing is copied);
``fetch`` ranges arrive from their sources and wait beside version v until the commit; on commit
the ``release`` ranges go and version v+1 is held; on abort what was fetched for v+1 is dropped
and version v stays. ``transferred`` counts the octets that ever arrived, so a test can show that
retained ranges never moved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvsp.core.container import Container
from kvsp.core.problems import IllegalTransition, LayersUnavailable, NotFound
from kvsp.core.records import ReshardPlan

__all__ = ["HeldRange", "ShardHoldings", "cut"]

Range = tuple[int, int]


@dataclass(frozen=True)
class HeldRange:
    tokens: Range
    #: a container of every layer of these tokens (token_count = end - start)
    kv: Container


@dataclass
class _Map:
    version: int
    held: list[HeldRange]
    plan: ReshardPlan | None = None
    retained: list[HeldRange] = field(default_factory=list)
    fetched: list[HeldRange] = field(default_factory=list)


def cut(held: HeldRange, tokens: Range) -> HeldRange:
    """The part of ``held`` for ``tokens``, viewing the same memory (each layer's K and V are
    token-major, so a token range is one contiguous slice of each section)."""
    start, end = held.tokens
    if tokens == held.tokens:
        return held
    if not start <= tokens[0] < tokens[1] <= end:
        raise LayersUnavailable(f"tokens {tokens} are not within {held.tokens}")
    count = end - start
    sections = []
    for layer in held.kv.layers:
        per_token = len(layer.k) // count
        lo, hi = (tokens[0] - start) * per_token, (tokens[1] - start) * per_token
        sections.append((layer.k[lo:hi], layer.v[lo:hi]))
    header = held.kv.header
    return HeldRange(
        tokens, Container.build(header.first_layer, tokens[1] - tokens[0], sections, header.codec)
    )


class ShardHoldings:
    def __init__(self) -> None:
        self._maps: dict[str, _Map] = {}
        self.transferred = 0

    def version(self, map_id: str) -> int:
        return self._get(map_id).version

    def ranges(self, map_id: str) -> list[Range]:
        return [h.tokens for h in self._get(map_id).held]

    def _get(self, map_id: str) -> _Map:
        found = self._maps.get(map_id)
        if found is None:
            raise NotFound(f"no shard map {map_id} held here")
        return found

    def load(self, map_id: str, version: int, held: Sequence[HeldRange]) -> None:
        """Hold the given ranges of a map at ``version`` (the first assignment)."""
        self._maps[map_id] = _Map(version, sorted(held, key=lambda h: h.tokens))

    def read(self, map_id: str, tokens: Range) -> HeldRange:
        """``tokens`` of a map held at its current version (what a peer fetches): one held
        range, a view into one, or several joined."""
        entry = self._get(map_id)
        lo, hi = tokens
        pieces = []
        covered = lo
        for held in entry.held:
            a, b = max(lo, held.tokens[0]), min(hi, held.tokens[1])
            if a < b and a == covered:
                pieces.append(cut(held, (a, b)))
                covered = b
        if covered != hi or lo >= hi:
            raise LayersUnavailable(f"tokens {lo}-{hi} of map {map_id} are not held")
        if len(pieces) == 1:
            return pieces[0]
        first = pieces[0].kv
        sections = [
            (
                b"".join(bytes(p.kv.layers[i].k) for p in pieces),
                b"".join(bytes(p.kv.layers[i].v) for p in pieces),
            )
            for i in range(first.header.layer_count)
        ]
        header = first.header
        joined = Container.build(header.first_layer, hi - lo, sections, header.codec)
        return HeldRange(tokens, joined)

    def begin(self, plan: ReshardPlan) -> None:
        """Open a plan: the ``retain`` ranges are taken from what is held (views, no copy)."""
        entry = self._maps.setdefault(plan.map, _Map(plan.from_, []))
        if entry.version != plan.from_:
            raise IllegalTransition(
                f"map {plan.map} is at version {entry.version}, not {plan.from_}"
            )
        retained = []
        for lo, hi in plan.retain:
            covered = lo
            for held in entry.held:
                a, b = max(lo, held.tokens[0]), min(hi, held.tokens[1])
                if a < b:
                    retained.append(cut(held, (a, b)))
                    covered += b - a
            if covered != hi:
                raise IllegalTransition(f"cannot retain tokens {lo}-{hi}: not all held here")
        entry.plan, entry.retained, entry.fetched = plan, retained, []

    def fetched(self, map_id: str, held: HeldRange) -> None:
        entry = self._get(map_id)
        if entry.plan is None or held.tokens not in [f.tokens for f in entry.plan.fetch]:
            raise IllegalTransition(f"tokens {held.tokens} are not to be fetched for map {map_id}")
        entry.fetched.append(held)
        self.transferred += held.kv.size

    def commit(self, map_id: str, version: int) -> None:
        entry = self._get(map_id)
        if entry.plan is None or entry.plan.to != version:
            raise IllegalTransition(f"no plan to version {version} of map {map_id} is open")
        entry.held = sorted([*entry.retained, *entry.fetched], key=lambda h: h.tokens)
        entry.version, entry.plan, entry.retained, entry.fetched = version, None, [], []

    def abort(self, map_id: str, version: int) -> None:
        entry = self._get(map_id)  # a map never seen here is NotFound
        if entry.plan is None or entry.plan.to != version:
            return  # nothing of that version was started here: nothing to undo
        entry.plan, entry.retained, entry.fetched = None, [], []
