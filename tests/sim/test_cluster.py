"""The simulated cluster against hand-computed times, and the invariants that tie the real
stores to the real index after whole runs (with failures and hints)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from kvsp.core.container import FIXED_HEADER_OCTETS
from kvsp.sim.cluster import Cluster, RequestResult
from kvsp.sim.policies import POLICIES, make_policy
from kvsp.sim.scenario import (
    ControllerSpec,
    InstanceSpec,
    LinkSpec,
    ModelShape,
    Moment,
    Scenario,
)
from kvsp.sim.workload import SimRequest, agentic, shared_prefix

#: 2 layers x (K, V) x 16 tokens x 1 head x 4 dims x 2 octets = 512 data octets per block
MODEL = ModelShape(layers=2, kv_heads=1, head_dim=4, element_octets=2, block_tokens=16)
SMALL = Scenario(
    name="three small instances",
    model=MODEL,
    instances=InstanceSpec(
        count=3,
        prefill_tokens_per_s=1_000,
        decode_step_ms=10,
        decode_ms_per_gbyte=0,
        g1_blocks=4,
        g2_blocks=8,
        host_read_mbit_per_s=8,
    ),
    # 1 Mbit/s: one octet takes 8 us
    links=LinkSpec(mbit_per_s=1, rtt_us=100),
    controller=ControllerSpec(mean_service_ms=500, ttft_slo_ms=100),
)


def keys(prefix: str, count: int) -> list[str]:
    return [f"{prefix}{n:063x}"[-64:] for n in range(count)]


def consistent(cluster: Cluster) -> None:
    """Every block a store holds is in the index under its holder, and nothing else is."""
    held = 0
    for node in cluster.nodes.values():
        for block in node.store.held():
            compat, scope, key = block
            found = cluster.index.lookup(compat, scope, [key])
            assert found
            assert node.url in {r.holder for r in found[0].replicas}
            held += 1
    assert cluster.index.count == held


def by_arrival(results: list[RequestResult]) -> list[RequestResult]:
    return sorted(results, key=lambda r: r.arrival_us)


def test_cold_local_and_fetched_prefixes_take_the_hand_computed_times() -> None:
    x = keys("a", 4)
    requests = [
        SimRequest(0, 0, "s1", x, 64, 1),  # cold at instance 0: 64 tokens at 1,000/s
        SimRequest(100, 0, "s2", keys("b", 125), 2_000, 1),  # keeps instance 0 busy to 2.1 s
        SimRequest(200, 0, "s1", [*x, *keys("c", 1)], 80, 1),  # X is at instance 0 only
    ]
    cluster = Cluster(SMALL, make_policy("kvsp"), 0)
    first, busy, third = by_arrival(cluster.run(requests))
    assert (first.instance, first.ttft_us, first.reused_tokens) == (0, 64_000, 0)
    assert (busy.instance, busy.ttft_us) == (0, 2_000_000)
    # instance 1 is idle; fetching X's 4 blocks from instance 0 (one round trip, then
    # 8 us per data octet: 4 x 4,096 us) beats waiting 500 ms at instance 0
    assert third.instance == 1
    assert third.reused_tokens == 64
    assert third.ttft_us == pytest.approx(100 + 4 * 4_096 + 16_000)
    assert third.fetched_octets == 4 * (FIXED_HEADER_OCTETS + 16 * 2 + 512)
    consistent(cluster)

    rr = Cluster(SMALL, make_policy("round-robin"), 0)
    third_rr = by_arrival(rr.run(requests))[2]
    assert (third_rr.instance, third_rr.reused_tokens, third_rr.ttft_us) == (2, 0, 80_000)


def test_reuse_from_g2_costs_the_host_read() -> None:
    x = keys("a", 4)
    requests = [
        SimRequest(0, 0, "s1", x, 64, 1),
        SimRequest(100, 0, "s2", keys("b", 4), 64, 1),  # pushes X from G1 (4 blocks) to G2
        SimRequest(200, 0, "s1", x, 64, 1),
    ]
    single = dataclasses.replace(SMALL, instances=dataclasses.replace(SMALL.instances, count=1))
    cluster = Cluster(single, make_policy("kvsp"), 0)
    again = by_arrival(cluster.run(requests))[2]
    assert again.reused_tokens == 64
    assert again.g2_octets == 4 * 512
    # 8 Mbit/s: one octet per microsecond; nothing is recomputed
    assert again.ttft_us == pytest.approx(4 * 512)
    consistent(cluster)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_serves_everything_and_keeps_the_index_true(policy: str) -> None:
    requests = shared_prefix(MODEL.compat_id, 16, groups=6, prompts_per_group=8, rate_per_s=40)
    requests += agentic(MODEL.compat_id, 16, sessions=12, session_rate_per_s=2)
    requests.sort(key=lambda r: r.arrival_ms)
    scenario = dataclasses.replace(SMALL, failures=(Moment(1, 2_000),))
    cluster = Cluster(scenario, make_policy(policy), 300)
    results = cluster.run(requests)
    assert len(results) == len(requests)
    assert all(math.isfinite(r.ttft_us) and r.ttft_us >= 0 for r in results)
    late = [r for r in results if r.arrival_us > 2_000_000]
    assert all(r.instance != 1 for r in late)  # nothing placed on the failed instance
    assert all(r.reused_tokens <= r.prompt_tokens for r in results)
    if not cluster.policy.infinite_cache:
        consistent(cluster)
        assert not cluster.instances[1].store.held()
        # every request released what it used: nothing stays in use after the last one
        assert all(i.refs.leased_count() == 0 for i in cluster.instances if i.alive)


def test_the_oracle_bounds_reuse_and_kvsp_reuses_more_than_local_caches() -> None:
    requests = shared_prefix(
        MODEL.compat_id, 16, groups=8, prompts_per_group=10, system_tokens=64, question_tokens=16
    )
    roomy = dataclasses.replace(
        SMALL,
        instances=dataclasses.replace(SMALL.instances, g1_blocks=16, g2_blocks=32),
        links=LinkSpec(mbit_per_s=10_000, rtt_us=100),
    )
    hit = {}
    for policy in ("round-robin", "least-loaded", "kvsp", "oracle"):
        results = Cluster(roomy, make_policy(policy), 100).run(requests)
        hit[policy] = sum(r.reused_tokens for r in results)
    assert hit["oracle"] >= hit["kvsp"] > max(hit["round-robin"], hit["least-loaded"])


def test_hints_are_planned_by_the_controller_and_carried_out_by_instances() -> None:
    requests = agentic(MODEL.compat_id, 16, sessions=20, session_rate_per_s=1, tool_share=1.0)
    cluster = Cluster(SMALL, make_policy("kvsp-hints"), 300)
    cluster.run(requests)
    hints = cluster.counters.hints
    assert any(k.startswith("kv.pin:") for k in hints)
    assert any(k.startswith("kv.demote:") for k in hints)  # each session's last turn
    consistent(cluster)


def test_attention_import_overhead_and_ingress_are_charged() -> None:
    x = keys("a", 4)
    instances = dataclasses.replace(
        SMALL.instances,
        attention_ns_per_pair=1_000,  # 1 us per (new token, attended token) pair
        import_mbit_per_s=8,  # one data octet per microsecond
        ingress_mbit_per_s=0.5,  # half the link's rate: 16 us per octet
        overhead_ms=2,
    )
    scenario = dataclasses.replace(SMALL, instances=instances)
    requests = [
        SimRequest(0, 0, "s1", x, 64, 1),
        SimRequest(100, 0, "s2", keys("b", 125), 2_000, 1),
        SimRequest(200, 0, "s1", [*x, *keys("c", 1)], 80, 1),
    ]
    first, _, third = by_arrival(Cluster(scenario, make_policy("kvsp"), 0).run(requests))
    assert first.ttft_us == pytest.approx(2_000 + 64_000 + 64 * 32)
    block_octets = FIXED_HEADER_OCTETS + 16 * 2 + 512
    fetch = 16 * 4 * block_octets  # ingress-bound, not link-bound
    compute = 2_000 + 16_000 + 16 * (64 + 8)
    assert third.instance == 1
    assert third.ttft_us == pytest.approx(fetch + 4 * 512 + compute)
