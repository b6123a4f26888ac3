"""Placement estimates of KVSP 6.4, checked against hand-computed figures."""

from __future__ import annotations

from typing import Any

import pytest

from kvsp.core.cost import (
    FetchPlanner,
    ReplicaSummary,
    estimate_cost,
    placement_cost,
    plan_fetch,
    recompute_us,
    transfer_us,
    wait_us,
)
from kvsp.core.records import InstanceStatusRecord, Link, ReplicaRecord

TARGET = "https://ii1.example/kvsp/"
H1 = "https://h1.example/kvsp/"
H2 = "https://h2.example/kvsp/"
LAYERS = 4
LAYER_OCTETS = 1000  # K + V of one layer
SIZE = 20 + 16 * LAYERS + LAYERS * LAYER_OCTETS


def record(
    holder: str, key: int = 0, residency: list[dict[str, Any]] | None = None
) -> ReplicaSummary:
    parsed = ReplicaRecord.parse(
        {
            "block_key": f"{key:064x}",
            "compat_id": "00" * 32,
            "scope_id": "00" * 16,
            "holder": holder,
            "codec": 1,
            "size": SIZE,
            "digest": "sha-256:" + "0" * 64,
            "residency": residency or [{"tier": "host", "layers": [0, LAYERS - 1]}],
            "ttl_ms": 1000,
        }
    )
    return ReplicaSummary.of(parsed)


def target(links: list[dict[str, Any]], queued: int = 0) -> InstanceStatusRecord:
    return InstanceStatusRecord.parse(
        {
            "instance": TARGET,
            "epoch": 1,
            "state": "active",
            "running": 0,
            "queued": queued,
            "batch_size": 8,
            "kv_utilization": 0.5,
            "prefill_tokens_per_s": 400,
            "decode_tokens_per_s": 15,
            "links": links,
            "ttl_ms": 3000,
        }
    )


def test_formulas() -> None:
    assert recompute_us(400, 400) == 1e6
    assert wait_us(3, 250.0) == 750.0
    assert placement_cost(10, 100, 50, 1000) == 160
    assert placement_cost(10, 5000, 50, 1000) == 1010


def test_transfer_uses_the_slower_of_link_and_tier() -> None:
    link = Link.parse({"holder": H1, "mbit_per_s": 8, "rtt_us": 5})  # 1 octet per us
    fast = record(H1)
    assert transfer_us(fast, link) == pytest.approx(LAYERS * LAYER_OCTETS)
    split = record(
        H1,
        residency=[
            {"tier": "device", "layers": [0, 1]},
            {"tier": "disk", "layers": [2, 3], "read_mbit_per_s": 4},  # half the link rate
        ],
    )
    assert transfer_us(split, link) == pytest.approx(2 * LAYER_OCTETS + 2 * 2 * LAYER_OCTETS)


def test_resident_blocks_cost_nothing() -> None:
    plan = plan_fetch(target([]), [[record(TARGET, 0)], [record(TARGET, 1)]])
    assert plan.fetch_us == 0
    assert plan.usable_blocks == 2
    assert plan.resident_blocks == 2


def test_max_over_sources_with_list_scheduling() -> None:
    status = target(
        [
            {"holder": H1, "mbit_per_s": 8, "rtt_us": 10},
            {"holder": H2, "mbit_per_s": 8, "rtt_us": 10},
        ]
    )
    block_us = LAYERS * LAYER_OCTETS
    matched = [[record(H1, i), record(H2, i)] for i in range(4)]
    plan = plan_fetch(status, matched)
    # four blocks spread over two equal sources: two blocks each, in parallel
    assert plan.fetch_us == pytest.approx(10 + 2 * block_us)
    assert sorted(len(v) for v in plan.sources.values()) == [2, 2]
    assert plan.octets_from == {H1: 2 * SIZE, H2: 2 * SIZE}


def test_unreachable_block_ends_the_usable_prefix() -> None:
    status = target([{"holder": H1, "mbit_per_s": 8, "rtt_us": 0}])
    matched = [[record(H1, 0)], [record(H2, 1)], [record(H1, 2)]]
    plan = plan_fetch(status, matched)
    assert plan.usable_blocks == 1
    assert plan.fetch_us == pytest.approx(LAYERS * LAYER_OCTETS)


def test_partial_replicas_are_not_sources() -> None:
    status = target([{"holder": H1, "mbit_per_s": 8, "rtt_us": 0}])
    partial = record(H1, 0, residency=[{"tier": "host", "layers": [0, 1]}])
    # layer count comes from residency without layer digests: 2 layers, complete
    assert plan_fetch(status, [[partial]]).usable_blocks == 1


def test_cost_prefers_recompute_when_fetch_is_slow() -> None:
    slow = target([{"holder": H1, "mbit_per_s": 0.001, "rtt_us": 0}], queued=2)
    cost = estimate_cost(
        slow, [[record(H1)]], block_tokens=16, prompt_tokens=40, mean_service_us=1000
    )
    assert cost.wait_us == 2000
    assert cost.reused_tokens == 16
    assert cost.recompute_all_us == pytest.approx(1e6 * 40 / 400)
    assert cost.recompute_unmatched_us == pytest.approx(1e6 * 24 / 400)
    assert not cost.uses_cache
    assert cost.cost_us == pytest.approx(2000 + cost.recompute_all_us)


def test_cost_uses_cache_when_fetch_is_fast() -> None:
    fast = target([{"holder": H1, "mbit_per_s": 8000, "rtt_us": 10}])
    cost = estimate_cost(fast, [[record(H1)]], block_tokens=16, prompt_tokens=40, mean_service_us=0)
    assert cost.uses_cache
    assert cost.cost_us == pytest.approx(cost.fetch_us + cost.recompute_unmatched_us)
    assert cost.instance == TARGET


def test_a_planner_shares_plans_between_targets_with_the_same_links_only() -> None:
    fast = {"mbit_per_s": 1000, "rtt_us": 100}
    matched = [[record(H1, 0), record(H2, 0)], [record(H1, 1)], [record(TARGET, 2)]]

    def at(url: str, h1: dict[str, Any], h2: dict[str, Any]) -> InstanceStatusRecord:
        status = target([{"holder": H1, **h1}, {"holder": H2, **h2}])
        return status.model_copy(update={"instance": url})

    a = at("https://a.example/kvsp/", fast, fast)
    b = at("https://b.example/kvsp/", fast, fast)
    slow = at("https://c.example/kvsp/", {"mbit_per_s": 10, "rtt_us": 100}, fast)
    holder = at(TARGET, fast, fast)
    planner = FetchPlanner(matched)
    plans = [planner.plan(s) for s in (a, b, slow, holder)]
    assert plans[0] is plans[1]
    for status, plan in zip((a, b, slow, holder), plans, strict=True):
        assert plan == plan_fetch(status, matched)
    assert plans[2].fetch_us > plans[0].fetch_us
    assert plans[3].resident_blocks == 1
