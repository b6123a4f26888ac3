"""Where a request runs (KVSP 6.4), pure: score every active instance, choose, and explain.

For each candidate i, ``cost(i) = wait_us(i) + min(fetch_us(i) + recompute_us_of_unmatched(i),
recompute_us_of_all(i))``. ``fetch_us`` comes from the Index Service's estimate for i when the
lookup carried i as a target and the IS answered one; otherwise the PC computes it from the
matched replicas with ``core/cost.py`` (the same formulas). The lowest cost among active
instances with capacity wins. When none is acceptable (its cost above ``max_cost_us``, or no
capacity: KV utilization or queue at their limits) the decision says to wake the cheapest
sleeping instance (or, with none asleep, to launch one) and to send it a prefetch directive at
once, so loading overlaps the start. Every decision keeps every candidate's terms, so logs and
metrics can say why.
"""

from __future__ import annotations

import heapq
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvsp.core.cost import (
    CostBreakdown,
    FetchPlanner,
    ReplicaSummary,
    breakdown,
    estimate_cost,
    recompute_us,
    transfer_us,
    wait_us,
)
from kvsp.core.problems import ConfigurationError
from kvsp.core.records import (
    InstanceStatusRecord,
    LookupResponse,
    PrefetchBlock,
    PrefetchDirective,
)
from kvsp.core.urls import canonical_url

__all__ = [
    "Decision",
    "Outcome",
    "PlacementPolicy",
    "PlacementRequest",
    "build_directive",
    "place",
]


class Outcome(StrEnum):
    PLACED = "placed"
    WAKE = "wake"
    LAUNCH = "launch"
    #: nothing acceptable, nothing to wake or launch: the cheapest active instance anyway
    OVERLOADED = "overloaded"
    #: no instance at all
    NONE = "none"


@dataclass(frozen=True, slots=True)
class PlacementPolicy:
    #: a candidate costing more than this (e.g. a TTFT objective) is not acceptable
    max_cost_us: float = float("inf")
    max_kv_utilization: float = 0.95
    max_queued: int = 64
    #: mean service time per queued request, for ``wait_us``
    mean_service_us: float = 500_000.0
    #: may the PC start instances through a launcher when none is acceptable
    can_launch: bool = False
    #: send prefetch directives where loading the cached prefix pays
    prefetch: bool = True
    prefetch_deadline_ms: int = 2_000
    prefetch_lease_ms: int = 10_000
    #: score every active instance (every term in the decision's record), or only those whose
    #: lower bound could still beat the best so far: the same choice, far less work with
    #: hundreds of instances
    score_all: bool = True

    def __post_init__(self) -> None:
        if self.max_kv_utilization <= 0 or self.max_queued < 0 or self.mean_service_us < 0:
            raise ConfigurationError("placement limits must be positive")


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    scope_id: str
    compat_id: str
    block_keys: tuple[str, ...]
    prompt_tokens: int
    block_tokens: int
    #: the first ``shared_blocks`` keys are a shared prefix's, in scope ``shared_scope``
    shared_scope: str | None = None
    shared_blocks: int = 0

    def parts(self) -> list[tuple[str, tuple[str, ...]]]:
        """The keys by scope, in order: the shared prefix's (if any), then the tenant's."""
        if self.shared_scope is None or not self.shared_blocks:
            return [(self.scope_id, self.block_keys)]
        n = self.shared_blocks
        return [(self.shared_scope, self.block_keys[:n]), (self.scope_id, self.block_keys[n:])]


@dataclass(frozen=True)
class Decision:
    outcome: Outcome
    instance: str | None
    candidates: tuple[CostBreakdown, ...]
    matched_blocks: int
    #: blocks the chosen instance can reuse (resident there or loadable)
    reused_blocks: int
    #: why no active instance was acceptable, when the outcome says so
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def chosen(self) -> CostBreakdown | None:
        return next((c for c in self.candidates if c.instance == self.instance), None)

    def to_json(self) -> dict[str, Any]:
        """The structured record logs and metrics use."""
        return {
            "outcome": self.outcome.value,
            "instance": self.instance,
            "matched_blocks": self.matched_blocks,
            "reused_blocks": self.reused_blocks,
            "reason": self.reason,
            "candidates": [
                {
                    "instance": c.instance,
                    "cost_us": round(c.cost_us, 1),
                    "wait_us": round(c.wait_us, 1),
                    "fetch_us": round(c.fetch_us, 1),
                    "reused_tokens": c.reused_tokens,
                    "recompute_unmatched_us": round(c.recompute_unmatched_us, 1),
                    "recompute_all_us": round(c.recompute_all_us, 1),
                    "uses_cache": c.uses_cache,
                }
                for c in self.candidates
            ],
        }


def _summaries(lookup: LookupResponse) -> list[list[ReplicaSummary]]:
    return [[ReplicaSummary.of(r) for r in block] for block in lookup.replicas]


def _score(
    status: InstanceStatusRecord,
    request: PlacementRequest,
    lookup: LookupResponse,
    planner: FetchPlanner,
    policy: PlacementPolicy,
) -> CostBreakdown:
    """One candidate's terms: the IS's estimate for it when there is one, else our own."""
    url = canonical_url(status.instance)
    estimate = next((e for e in lookup.estimates if canonical_url(e.target) == url), None)
    if estimate is None or estimate.fetch_blocks is None:
        return estimate_cost(
            status, planner, request.block_tokens, request.prompt_tokens, policy.mean_service_us
        )
    return breakdown(
        status,
        estimate.fetch_us,
        estimate.fetch_blocks,
        request.block_tokens,
        request.prompt_tokens,
        policy.mean_service_us,
    )


def _has_capacity(status: InstanceStatusRecord, policy: PlacementPolicy) -> bool:
    return status.kv_utilization < policy.max_kv_utilization and status.queued < policy.max_queued


def _lower_bound(
    status: InstanceStatusRecord,
    url: str,
    request: PlacementRequest,
    planner: FetchPlanner,
    policy: PlacementPolicy,
) -> float:
    """No more than the candidate's cost: its wait plus recomputing what the lookup did not
    match, plus, when the candidate lacks a matched block, the cheaper of moving the first such
    block (its fastest single transfer) and recomputing it (it is either fetched or, with all
    that follows it, recomputed); never more than recomputing everything."""
    rate = status.prefill_tokens_per_s
    bt = request.block_tokens
    matched_tokens = min(len(planner.matched) * bt, request.prompt_tokens)
    floor = recompute_us(request.prompt_tokens - matched_tokens, rate)
    first = next((j for j, held in enumerate(planner.holders_of) if url not in held), None)
    if first is not None:
        moving = recompute_us(min(bt, max(matched_tokens - first * bt, 0)), rate)
        for replica in planner.matched[first]:
            link = status.link_to(replica.holder) if replica.complete else None
            if link is not None:
                moving = min(moving, link.rtt_us + transfer_us(replica, link))
        floor += moving
    everything = recompute_us(request.prompt_tokens, rate)
    return wait_us(status.queued, policy.mean_service_us) + min(floor, everything)


def _place_pruned(
    request: PlacementRequest,
    lookup: LookupResponse,
    planner: FetchPlanner,
    active: Sequence[InstanceStatusRecord],
    policy: PlacementPolicy,
) -> Decision | None:
    """The acceptable instance of lowest cost, taking candidates in the order of a lower bound
    of their cost (the wait plus recomputing the unmatched tokens, refined with
    ``_lower_bound`` the first time a candidate comes up) and stopping once no bound can
    beat or tie the best (ties go to the URL that sorts first, as in full scoring); None when
    no instance with capacity is acceptable, for the full scoring to explain."""
    candidates = [s for s in active if _has_capacity(s, policy)]
    # the unrefined bound, inline: with hundreds of candidates this loop is the hot one
    bt, mean = request.block_tokens, policy.mean_service_us
    rest = request.prompt_tokens - min(len(planner.matched) * bt, request.prompt_tokens)
    heap = [
        (s.queued * mean + 1e6 * rest / s.prefill_tokens_per_s, canonical_url(s.instance), False, n)
        for n, s in enumerate(candidates)
    ]
    heapq.heapify(heap)
    scored: list[tuple[CostBreakdown, str]] = []
    best: tuple[CostBreakdown, str] | None = None
    while heap:
        bound, url, refined, n = heapq.heappop(heap)
        if best is not None and (bound, url) > (best[0].cost_us, best[1]):
            break
        status = candidates[n]
        if not refined:
            tighter = _lower_bound(status, url, request, planner, policy)
            if tighter > bound:
                heapq.heappush(heap, (tighter, url, True, n))
                continue
        cost = _score(status, request, lookup, planner, policy)
        scored.append((cost, url))
        if cost.cost_us <= policy.max_cost_us and (
            best is None or (cost.cost_us, url) < (best[0].cost_us, best[1])
        ):
            best = (cost, url)
    if best is None:
        return None
    scored.sort(key=lambda pair: (pair[0].cost_us, pair[1]))
    reused = best[0].reused_tokens // request.block_tokens
    return Decision(
        Outcome.PLACED, best[0].instance, tuple(c for c, _ in scored), lookup.matched, reused
    )


def place(
    request: PlacementRequest,
    lookup: LookupResponse,
    active: Sequence[InstanceStatusRecord],
    sleeping: Sequence[InstanceStatusRecord],
    policy: PlacementPolicy,
    summaries: list[list[ReplicaSummary]] | FetchPlanner | None = None,
) -> Decision:
    """The decision for one request (ties go to the instance URL that sorts first).

    ``summaries`` are the lookup's replicas as cost summaries (or a planner over them, whose
    plans the caller can read afterwards), for a caller that already has them (an embedded
    index keeps one per record); otherwise they come from ``lookup``."""
    if isinstance(summaries, FetchPlanner):
        planner = summaries
    else:
        planner = FetchPlanner(_summaries(lookup) if summaries is None else summaries)
    if not policy.score_all:
        pruned = _place_pruned(request, lookup, planner, active, policy)
        if pruned is not None:
            return pruned
    scored = sorted(
        ((_score(s, request, lookup, planner, policy), s) for s in active),
        key=lambda pair: (pair[0].cost_us, canonical_url(pair[1].instance)),
    )
    candidates = tuple(c for c, _ in scored)

    def reused(c: CostBreakdown) -> int:
        return c.reused_tokens // request.block_tokens

    acceptable = [
        (c, s) for c, s in scored if c.cost_us <= policy.max_cost_us and _has_capacity(s, policy)
    ]
    if acceptable:
        best = acceptable[0][0]
        return Decision(Outcome.PLACED, best.instance, candidates, lookup.matched, reused(best))
    reason = "no active instance" if not scored else "every active instance is over its limits"
    asleep = sorted(
        ((_score(s, request, lookup, planner, policy), s) for s in sleeping),
        key=lambda pair: (pair[0].cost_us, canonical_url(pair[1].instance)),
    )
    if asleep:
        best = asleep[0][0]
        return Decision(
            Outcome.WAKE,
            best.instance,
            candidates + tuple(c for c, _ in asleep),
            lookup.matched,
            reused(best),
            reason,
        )
    if policy.can_launch:
        return Decision(Outcome.LAUNCH, None, candidates, lookup.matched, 0, reason)
    if scored:
        best = candidates[0]
        return Decision(
            Outcome.OVERLOADED, best.instance, candidates, lookup.matched, reused(best), reason
        )
    return Decision(Outcome.NONE, None, candidates, lookup.matched, 0, reason)


def build_directive(
    request: PlacementRequest,
    lookup: LookupResponse,
    instance: str,
    policy: PlacementPolicy,
    request_ref: str | None = None,
) -> PrefetchDirective | None:
    """A prefetch directive (KVSP 6.5) loading the matched prefix into ``instance`` from the
    holders the lookup named, leaving out blocks already resident there; None when there is
    nothing to load."""
    here = canonical_url(instance)
    blocks = []
    for key, records in zip(request.block_keys, lookup.replicas, strict=False):
        holders = [canonical_url(r.holder) for r in records]
        if here in holders:
            continue
        sources = tuple(dict.fromkeys(h for h in holders if h.startswith(("http://", "https://"))))
        if not sources:
            break  # chained keys: nothing after an unloadable block is usable
        blocks.append(PrefetchBlock(block_key=key, sources=sources))
    if not blocks:
        return None
    return PrefetchDirective(
        directive=str(uuid.uuid4()),
        request_ref=request_ref,
        scope_id=request.scope_id,
        compat_id=request.compat_id,
        blocks=tuple(blocks),
        deadline_ms=policy.prefetch_deadline_ms,
        lease_ms=policy.prefetch_lease_ms,
    )
