"""Where a prompt's prefix is cached, per holder and medium, pure: the answer a router reads.

The indexers routers already query (Mooncake's indexer API, RFC #1403, which Dynamo's standalone
indexer follows) answer per engine instance with the longest matched prefix in tokens, per
medium and cumulative: ``gpu`` counts the leading blocks held in device memory, ``cpu`` those
held in device or host memory, ``disk`` those held anywhere there (so gpu <= cpu <= disk), and
``longest_matched`` is ``disk``. kvsp keeps those names so a router written for either reads
kvsp's answer unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvsp.core.cost import FetchPlanner, ReplicaSummary, estimate_cost
from kvsp.core.records import InstanceStatusRecord, ReplicaRecord
from kvsp.core.urls import canonical_url

__all__ = ["Overlap", "overlap_by_holder", "prefix_report"]

_GPU = frozenset({"device"})
_CPU = frozenset({"device", "host"})


@dataclass(slots=True)
class Overlap:
    """Leading blocks of the prompt one holder has, per medium (cumulative, see above)."""

    gpu: int = 0
    cpu: int = 0
    disk: int = 0

    def to_json(self, block_tokens: int, prompt_tokens: int) -> dict[str, int]:
        def tokens(blocks: int) -> int:
            return min(blocks * block_tokens, prompt_tokens)

        return {
            "longest_matched": tokens(self.disk),
            "gpu": tokens(self.gpu),
            "cpu": tokens(self.cpu),
            "disk": tokens(self.disk),
        }


def overlap_by_holder(replicas: Sequence[Sequence[ReplicaRecord]]) -> dict[str, Overlap]:
    """Per holder (canonical URL), how many leading blocks of a lookup answer it holds in each
    medium; ``replicas`` lists each matched block's records, in prompt order."""
    out: dict[str, Overlap] = {}
    for index, records in enumerate(replicas):
        tiers: dict[str, set[str]] = {}
        for record in records:
            tiers.setdefault(canonical_url(record.holder), set()).update(
                r.tier for r in record.residency
            )
        if index == 0:
            out = {holder: Overlap() for holder in tiers}
        for holder, overlap in out.items():
            held = tiers.get(holder)
            if held is None or overlap.disk < index:
                continue  # its run ended at an earlier block
            overlap.disk += 1
            if overlap.cpu == index and not _CPU.isdisjoint(held):
                overlap.cpu += 1
            if overlap.gpu == index and not _GPU.isdisjoint(held):
                overlap.gpu += 1
    return out


def prefix_report(
    replicas: Sequence[Sequence[ReplicaRecord]],
    active: Sequence[InstanceStatusRecord],
    block_tokens: int,
    prompt_tokens: int,
    mean_service_us: float,
) -> dict[str, dict[str, dict[str, Any]]]:
    """The router query's ``instances`` and ``holders``: every active instance (with the
    placement terms of serving the prompt there: ``fetch_us``, ``recompute_us``, ``wait_us``,
    ``cost_us``) and every engine with records (a holder with a device tier, such as a vLLM
    pod whose events are ingested) under ``instances``, other holders under ``holders``."""
    overlaps = overlap_by_holder(replicas)
    planner = FetchPlanner([[ReplicaSummary.of(r) for r in block] for block in replicas])
    instances: dict[str, dict[str, Any]] = {}
    for status in active:
        url = canonical_url(status.instance)
        cost = estimate_cost(status, planner, block_tokens, prompt_tokens, mean_service_us)
        entry = overlaps.pop(url, Overlap()).to_json(block_tokens, prompt_tokens)
        instances[url] = {
            **entry,
            "dp": {"0": entry["gpu"]},
            "fetch_us": round(cost.fetch_us, 1),
            "recompute_us": round(cost.recompute_unmatched_us, 1),
            "wait_us": round(cost.wait_us, 1),
            "cost_us": round(cost.cost_us, 1),
        }
    holders: dict[str, dict[str, Any]] = {}
    for url, overlap in overlaps.items():
        entry = overlap.to_json(block_tokens, prompt_tokens)
        if overlap.gpu:
            instances[url] = {**entry, "dp": {"0": entry["gpu"]}}
        else:
            holders[url] = entry
    return {"instances": instances, "holders": holders}
