"""The placement policies a simulation compares, side by side on the same cluster model.

- ``round-robin``: the next live instance in turn; each instance reuses only its own cache.
- ``least-loaded``: the instance with the fewest queued, then running, requests; own cache.
- ``overlap``: local-prefix affinity as Dynamo's KV router scores it: ``w x potential prefill
  blocks + potential decode blocks``, where prefill blocks are the prompt's blocks not in the
  instance's cache plus the prefill work already queued there, and decode blocks the KV blocks
  its running requests hold plus this prompt's; the overlap comes from the index (the router's
  view of every worker's cache, built from their KV events); own cache only.
- ``kvsp``: ``controller.placement.place`` over the Index Service's answer and every live
  instance's status: fetch-versus-recompute against every holder of the prefix, with a
  prefetch directive so the transfer overlaps the queue.
- ``kvsp-hints``: ``kvsp`` plus the controller's KvHints (``PinOrDemote``) at each turn's end.
- ``oracle``: an infinite cache shared by every instance at no cost, on the instance free
  soonest: the upper bound of reuse.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvsp.controller.placement import PlacementPolicy, PlacementRequest, place
from kvsp.core.cost import FetchPlanner
from kvsp.core.problems import ConfigurationError
from kvsp.core.records import LookupResponse
from kvsp.holder.blocks import BlockId
from kvsp.index.replicas import summary_of
from kvsp.sim.cluster import Choice, Cluster, SimInstance
from kvsp.sim.workload import SimRequest

__all__ = [
    "POLICIES",
    "KvspCost",
    "LeastLoaded",
    "Oracle",
    "OverlapScore",
    "Replay",
    "RoundRobin",
    "make_policy",
]


@dataclass
class RoundRobin:
    name: str = "round-robin"
    infinite_cache: bool = False
    hints: bool = False
    _next: int = 0

    def choose(self, cluster: Cluster, request: SimRequest, blocks: list[BlockId]) -> Choice:
        active = cluster.active()
        inst = active[self._next % len(active)]
        self._next += 1
        return Choice(inst)


@dataclass
class LeastLoaded:
    name: str = "least-loaded"
    infinite_cache: bool = False
    hints: bool = False

    def choose(self, cluster: Cluster, request: SimRequest, blocks: list[BlockId]) -> Choice:
        now = cluster.now_us
        inst = min(cluster.active(), key=lambda i: (i.queued(now), i.decoding, i.index))
        return Choice(inst)


@dataclass
class OverlapScore:
    name: str = "overlap"
    infinite_cache: bool = False
    hints: bool = False
    #: Dynamo's ``kv-overlap-score-weight`` (its default)
    weight: float = 1.0

    def choose(self, cluster: Cluster, request: SimRequest, blocks: list[BlockId]) -> Choice:
        scope = cluster.scope(request.tenant)
        found = cluster.index.lookup(cluster.compat, scope, request.keys)
        overlap: dict[str, int] = {}
        holders: set[str] | None = None
        for n, block in enumerate(found):
            here = {r.holder for r in block.replicas}
            holders = here if holders is None else holders & here
            if not holders:
                break
            for url in holders:
                overlap[url] = n + 1
        bt = cluster.scenario.model.block_tokens
        token_blocks = cluster.scenario.model.token_octets * bt
        prompt_blocks = -(-request.prompt_tokens // bt)
        rate = cluster.scenario.instances.prefill_tokens_per_s
        now = cluster.now_us

        def logit(inst: SimInstance) -> tuple[float, int]:
            queued_blocks = max(inst.free_at - now, 0.0) * rate / 1e6 / bt
            prefill = prompt_blocks - overlap.get(inst.url, 0) + queued_blocks
            decode = inst.batch_octets / token_blocks + prompt_blocks
            return self.weight * prefill + decode, inst.index

        return Choice(min(cluster.active(), key=logit))


@dataclass
class KvspCost:
    name: str = "kvsp"
    infinite_cache: bool = False
    hints: bool = False
    placement: PlacementPolicy | None = field(default=None)

    def choose(self, cluster: Cluster, request: SimRequest, blocks: list[BlockId]) -> Choice:
        if self.placement is None:
            self.placement = PlacementPolicy(
                mean_service_us=cluster.mean_service_us, score_all=False, max_queued=1 << 20
            )
        scope = cluster.scope(request.tenant)
        found = cluster.index.lookup(cluster.compat, scope, request.keys)
        summaries = [[summary_of(r) for r in block.replicas] for block in found]
        active = cluster.active()
        statuses = [cluster.status(i) for i in active]
        bt = cluster.scenario.model.block_tokens
        wanted = PlacementRequest(
            scope, cluster.compat, tuple(request.keys), request.prompt_tokens, bt
        )
        lookup = LookupResponse.model_construct(matched=len(found), replicas=(), estimates=())
        planner = FetchPlanner(summaries)
        decision = place(wanted, lookup, statuses, [], self.placement, planner)
        inst = cluster.nodes[decision.instance]  # type: ignore[index]
        assert isinstance(inst, SimInstance)
        chosen = decision.chosen
        if chosen is None or not chosen.uses_cache:
            return Choice(inst)
        return _fetching(cluster, inst, planner, self.placement.prefetch)


def _fetching(cluster: Cluster, inst: SimInstance, planner: FetchPlanner, prefetch: bool) -> Choice:
    """``inst`` loading the matched prefix as its fetch plan says."""
    plan = planner.plan(cluster.status(inst))
    return Choice(
        inst,
        usable_blocks=plan.usable_blocks,
        fetch_us=plan.fetch_us,
        fetch_octets=sum(plan.octets_from.values()),
        prefetch=prefetch,
    )


@dataclass
class Replay:
    """Each request on the instance it names (``SimRequest.instance``), which loads every
    matched block it lacks as a real instance does: replays placements made elsewhere (a real
    controller's, for validation)."""

    name: str = "replay"
    infinite_cache: bool = False
    hints: bool = False

    def choose(self, cluster: Cluster, request: SimRequest, blocks: list[BlockId]) -> Choice:
        if request.instance is None:
            raise ConfigurationError("a replayed request names its instance")
        found = cluster.index.lookup(cluster.compat, cluster.scope(request.tenant), request.keys)
        planner = FetchPlanner([[summary_of(r) for r in block.replicas] for block in found])
        return _fetching(cluster, cluster.instances[request.instance], planner, False)


@dataclass
class Oracle:
    name: str = "oracle"
    infinite_cache: bool = True
    hints: bool = False

    def choose(self, cluster: Cluster, request: SimRequest, blocks: list[BlockId]) -> Choice:
        return Choice(min(cluster.active(), key=lambda i: (i.free_at, i.index)))


#: every policy by name, in report order
POLICIES = ("round-robin", "least-loaded", "overlap", "kvsp", "kvsp-hints", "oracle")


def make_policy(name: str) -> RoundRobin | LeastLoaded | OverlapScore | KvspCost | Oracle:
    """A fresh policy (policies keep state: one per run)."""
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    if name == "overlap":
        return OverlapScore()
    if name == "kvsp":
        return KvspCost()
    if name == "kvsp-hints":
        return KvspCost(name="kvsp-hints", hints=True)
    if name == "oracle":
        return Oracle()
    raise ConfigurationError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
