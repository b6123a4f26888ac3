"""Placement estimates of KVSP 6.4 as pure functions over records.

Units: rates in Mbit/s (1 Mbit/s moves one bit per microsecond, so ``8 * octets / mbit_per_s``
is microseconds), times in microseconds, sizes in octets.

``plan_fetch`` turns a lookup answer into the time to make the matched prefix resident at one
instance: blocks the instance already holds cost nothing; every other block goes to the source
that finishes it earliest given what that source already carries (list scheduling), and the
estimate is the latest finishing source, ``max_s (rtt_us(i,s) + 8 * bytes_from(s) / rate)``.
A source's rate is the instance's link rate to it, reduced for each layer range to the tier's
``read_mbit_per_s``. A block no reachable source holds ends the usable prefix: Block Keys are
chained, so nothing after it can be used.

The functions take ``ReplicaSummary``: the few members of a Replica Record the estimate reads,
small enough for an index to keep beside every record.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvsp.core.container import FIXED_HEADER_OCTETS
from kvsp.core.records import InstanceStatusRecord, Link, ReplicaRecord
from kvsp.core.registries import SERVED_CODECS
from kvsp.core.urls import canonical_url

__all__ = [
    "CostBreakdown",
    "FetchPlan",
    "FetchPlanner",
    "ReplicaSummary",
    "TierSpan",
    "breakdown",
    "estimate_cost",
    "placement_cost",
    "plan_fetch",
    "recompute_us",
    "transfer_us",
    "wait_us",
]


def recompute_us(tokens: int, prefill_tokens_per_s: float) -> float:
    """``1e6 * tokens / prefill_tokens_per_s``."""
    return 1e6 * tokens / prefill_tokens_per_s


def wait_us(queued: int, mean_service_us: float) -> float:
    """``queued(i) * mean service time at i``."""
    return queued * mean_service_us


def placement_cost(
    wait: float, fetch: float, recompute_unmatched: float, recompute_all: float
) -> float:
    """``wait + min(fetch + recompute_of_unmatched, recompute_of_all)``."""
    return wait + min(fetch + recompute_unmatched, recompute_all)


@dataclass(frozen=True, slots=True)
class TierSpan:
    """Layers ``first..last`` of a replica in one tier, read at ``read_mbit_per_s`` (None:
    as fast as the link)."""

    first: int
    last: int
    read_mbit_per_s: float | None


@dataclass(frozen=True, slots=True)
class ReplicaSummary:
    """What the cost model needs of a Replica Record, small enough to keep per record
    (``holder`` in canonical form)."""

    holder: str
    size: int
    layer_count: int
    spans: tuple[TierSpan, ...]
    complete: bool
    #: per span: (bits of its layers, its tier read rate or None), for ``transfer_us``
    span_bits: tuple[tuple[float, float | None], ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        data = max(self.size - FIXED_HEADER_OCTETS - 16 * self.layer_count, 0)
        per_layer = data / self.layer_count
        bits = tuple(
            (8 * per_layer * (s.last - s.first + 1), s.read_mbit_per_s) for s in self.spans
        )
        object.__setattr__(self, "span_bits", bits)

    @classmethod
    def of(cls, record: ReplicaRecord) -> ReplicaSummary:
        layers = record.layer_count
        return cls(
            holder=canonical_url(record.holder),
            size=record.size,
            layer_count=layers,
            spans=tuple(
                TierSpan(r.layers[0], r.layers[1], r.read_mbit_per_s) for r in record.residency
            ),
            # a source must hold every layer in a codec holders serve (an engine's own pages
            # count only at that engine: the ``holder == here`` case of ``plan_fetch``)
            complete=record.codec in SERVED_CODECS and record.holds_layers(0, layers - 1),
        )


def transfer_us(replica: ReplicaSummary, link: Link) -> float:
    """Time to move every layer of ``replica`` over ``link``, each tier span at
    ``min(link rate, tier read rate)``; excludes the round trip."""
    rate = link.mbit_per_s
    return sum(
        bits / (rate if read is None else min(rate, read)) for bits, read in replica.span_bits
    )


@dataclass(frozen=True, slots=True)
class FetchPlan:
    """How the matched prefix would become resident at one instance."""

    fetch_us: float
    usable_blocks: int
    resident_blocks: int
    sources: dict[str, list[int]] = field(default_factory=dict)
    octets_from: dict[str, int] = field(default_factory=dict)


def plan_fetch(
    target: InstanceStatusRecord, matched: Sequence[Sequence[ReplicaSummary]]
) -> FetchPlan:
    """Assign each matched block to a source reachable from ``target`` (see module doc)."""
    finish: dict[str, float] = {}
    sources: dict[str, list[int]] = {}
    octets: dict[str, int] = {}
    resident = 0
    usable = 0
    here = canonical_url(target.instance)
    links: dict[str, Link | None] = {}  # one link lookup per holder, not per record
    # This loop runs targets x blocks x replicas times per lookup: kept flat on purpose.
    for index, records in enumerate(matched):
        best_done = 0.0
        best: ReplicaSummary | None = None
        for record in records:
            holder = record.holder
            if holder == here:
                break
            if not record.complete:
                continue
            link = (
                links[holder]
                if holder in links
                else links.setdefault(holder, target.link_to(holder))
            )
            if link is None:
                continue
            done = finish.get(holder, float(link.rtt_us)) + transfer_us(record, link)
            if best is None or done < best_done or (done == best_done and holder < best.holder):
                best_done, best = done, record
        else:
            if best is None:
                break
            holder = best.holder
            finish[holder] = best_done
            sources.setdefault(holder, []).append(index)
            octets[holder] = octets.get(holder, 0) + best.size
            usable += 1
            continue
        resident += 1  # the loop broke: the target holds this block
        usable += 1
    return FetchPlan(max(finish.values(), default=0.0), usable, resident, sources, octets)


class FetchPlanner:
    """``plan_fetch`` for many targets of one lookup answer.

    A target that holds none of the matched blocks gets the plan of any earlier such target
    with the same links (rate and round trip) to the holders involved: the plan depends on
    nothing else, so a homogeneous cluster of hundreds of instances costs one plan per lookup
    plus one per instance holding part of the prefix, not one per instance."""

    def __init__(self, matched: Sequence[Sequence[ReplicaSummary]]) -> None:
        self.matched = matched
        #: per matched block, every holder of a replica (a target among them has it resident)
        self.holders_of = [frozenset(r.holder for r in block) for block in matched]
        self._holder_set = frozenset().union(*self.holders_of)
        self.holders = tuple(sorted(self._holder_set))
        self._plans: dict[tuple[tuple[float, float] | None, ...], FetchPlan] = {}
        self._holder_plans: dict[str, FetchPlan] = {}

    def plan(self, target: InstanceStatusRecord) -> FetchPlan:
        here = canonical_url(target.instance)
        if here in self._holder_set:
            found = self._holder_plans.get(here)
            if found is None:
                found = self._holder_plans[here] = plan_fetch(target, self.matched)
            return found
        links = (target.link_to(h) for h in self.holders)
        key = tuple(None if link is None else (link.mbit_per_s, link.rtt_us) for link in links)
        found = self._plans.get(key)
        if found is None:
            found = self._plans[key] = plan_fetch(target, self.matched)
        return found


@dataclass(frozen=True, slots=True)
class CostBreakdown:
    """Every term of ``cost(i)`` for one candidate, for decisions that explain themselves."""

    instance: str
    wait_us: float
    fetch_us: float
    reused_tokens: int
    recompute_unmatched_us: float
    recompute_all_us: float
    cost_us: float

    @property
    def uses_cache(self) -> bool:
        return self.fetch_us + self.recompute_unmatched_us < self.recompute_all_us


def breakdown(
    target: InstanceStatusRecord,
    fetch_us: float,
    loadable_blocks: int,
    block_tokens: int,
    prompt_tokens: int,
    mean_service_us: float,
) -> CostBreakdown:
    """``cost(i)`` from the time to load ``loadable_blocks`` blocks of the matched prefix."""
    reused = min(loadable_blocks * block_tokens, prompt_tokens)
    rate = target.prefill_tokens_per_s
    unmatched = recompute_us(prompt_tokens - reused, rate)
    everything = recompute_us(prompt_tokens, rate)
    wait = wait_us(target.queued, mean_service_us)
    return CostBreakdown(
        instance=target.instance,
        wait_us=wait,
        fetch_us=fetch_us,
        reused_tokens=reused,
        recompute_unmatched_us=unmatched,
        recompute_all_us=everything,
        cost_us=placement_cost(wait, fetch_us, unmatched, everything),
    )


def estimate_cost(
    target: InstanceStatusRecord,
    matched: Sequence[Sequence[ReplicaSummary]] | FetchPlanner,
    block_tokens: int,
    prompt_tokens: int,
    mean_service_us: float,
) -> CostBreakdown:
    """``cost(i)`` of serving a ``prompt_tokens`` prompt at ``target`` given a lookup answer
    (or a planner over one, shared by the candidates of one decision)."""
    if isinstance(matched, FetchPlanner):
        plan = matched.plan(target)
    else:
        plan = plan_fetch(target, matched)
    return breakdown(
        target, plan.fetch_us, plan.usable_blocks, block_tokens, prompt_tokens, mean_service_us
    )
