"""Placement (KVSP 6.4) against hand-computed costs, and prefetch directives (6.5)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp.controller.instances import InstanceTable
from kvsp.controller.placement import (
    Outcome,
    PlacementPolicy,
    PlacementRequest,
    build_directive,
    place,
)
from kvsp.core.clock import ManualClock
from kvsp.core.records import InstanceState, LookupResponse, ReplicaRecord
from tests.index.factories import COMPAT, H1, H2, I1, I2, SCOPE_A, key, replica, status

I3 = "http://127.0.0.1:9203/kvsp/"
LINK_H1 = [{"holder": H1, "mbit_per_s": 1000, "rtt_us": 100}]
POLICY = PlacementPolicy(mean_service_us=500_000)


def request(blocks: int = 4, prompt_tokens: int = 80) -> PlacementRequest:
    return PlacementRequest(
        SCOPE_A, COMPAT, tuple(key(n) for n in range(blocks)), prompt_tokens, 16
    )


def lookup(
    replicas: list[list[ReplicaRecord]], estimates: list[dict] | None = None
) -> LookupResponse:
    return LookupResponse.parse(
        {
            "matched": len(replicas),
            "replicas": [[r.to_json() for r in block] for block in replicas],
            "estimates": estimates or [],
        }
    )


MATCHED = lookup([[replica(n, H1)] for n in range(4)])


def test_6_4_costs_match_hand_computed_values() -> None:
    # a block is 4 layers x 1000 octets: 8 * 4000 / 1000 Mbit/s = 32 us; four of them after one
    # round trip of 100 us: fetch 228 us. 64 of 80 tokens reused: recompute 16 tokens at 400/s =
    # 40,000 us; recomputing all 80 costs 200,000 us.
    decision = place(request(), MATCHED, [status(I1, links=LINK_H1), status(I2)], [], POLICY)
    assert decision.outcome is Outcome.PLACED
    assert decision.instance == I1
    first, second = decision.candidates
    assert (first.instance, first.fetch_us, first.recompute_unmatched_us) == (I1, 228, 40_000)
    assert first.cost_us == 40_228
    assert first.uses_cache
    assert (second.instance, second.fetch_us, second.cost_us) == (I2, 0, 200_000)
    assert not second.uses_cache
    assert decision.reused_blocks == 4
    doc = decision.to_json()
    assert doc["instance"] == I1
    assert [c["cost_us"] for c in doc["candidates"]] == [40_228, 200_000]


def test_6_4_recompute_wins_when_fetching_is_slower() -> None:
    slow = [{"holder": H1, "mbit_per_s": 0.1, "rtt_us": 100}]
    decision = place(request(), MATCHED, [status(I1, links=slow)], [], POLICY)
    (only,) = decision.candidates
    assert only.fetch_us == 100 + 4 * 8 * 4000 / 0.1
    assert only.cost_us == 200_000  # min(fetch + 40,000, 200,000)


def test_6_4_the_index_estimate_is_used_when_it_gives_one() -> None:
    answer = lookup(
        [[replica(n, H1)] for n in range(4)],
        [{"target": I2, "fetch_us": 50, "recompute_us": 160_000, "fetch_blocks": 4}],
    )
    decision = place(request(), answer, [status(I1, links=LINK_H1), status(I2)], [], POLICY)
    assert decision.instance == I2
    assert decision.chosen is not None
    assert decision.chosen.cost_us == 40_050


def test_6_4_waiting_counts_queued_requests() -> None:
    decision = place(
        request(), MATCHED, [status(I1, links=LINK_H1, queued=1), status(I2)], [], POLICY
    )
    assert decision.instance == I2  # 500,000 us of queue outweighs the 160,000 us saved
    assert decision.candidates[1].wait_us == 500_000


def test_6_3_pc_must_not_assign_requests_to_an_instance_that_is_not_active() -> None:
    clock = ManualClock()
    table = InstanceTable(clock)
    table.put_status(status(I1, links=LINK_H1))
    table.put_status(status(I2))
    table.set_state(I1, InstanceState.DRAINING)
    active = [i.status for i in table.active()]
    decision = place(request(), MATCHED, active, [], POLICY)
    assert decision.instance == I2
    assert [c.instance for c in decision.candidates] == [I2]


def test_6_4_no_acceptable_instance_wakes_a_sleeping_one() -> None:
    policy = PlacementPolicy(mean_service_us=500_000, max_kv_utilization=0.9)
    decision = place(
        request(),
        MATCHED,
        [status(I1, kv_utilization=0.95)],
        [status(I2, state="sleeping"), status(I3, state="sleeping", links=LINK_H1)],
        policy,
    )
    assert decision.outcome is Outcome.WAKE
    assert decision.instance == I3  # the sleeping one that can load the prefix
    assert "limits" in decision.reason


@pytest.mark.parametrize(
    ("can_launch", "outcome"), [(True, Outcome.LAUNCH), (False, Outcome.OVERLOADED)]
)
def test_6_4_nothing_to_wake(can_launch: bool, outcome: Outcome) -> None:
    policy = PlacementPolicy(max_cost_us=1_000, can_launch=can_launch)
    decision = place(request(), MATCHED, [status(I1)], [], policy)
    assert decision.outcome is outcome
    assert place(request(), MATCHED, [], [], PlacementPolicy()).outcome is Outcome.NONE


def test_6_5_directive_loads_what_the_target_lacks_from_the_lookup_sources() -> None:
    answer = lookup([[replica(0, I1)], [replica(1, H1), replica(1, H2)], [replica(2, H2)]])
    directive = build_directive(request(3), answer, I1, POLICY, request_ref="r1")
    assert directive is not None
    assert [b.block_key for b in directive.blocks] == [key(1), key(2)]  # block 0 is resident
    assert directive.blocks[0].sources == (H1, H2)
    assert (directive.deadline_ms, directive.lease_ms) == (2_000, 10_000)
    assert directive.request_ref == "r1"
    assert build_directive(request(1), lookup([[replica(0, I1)]]), I1, POLICY) is None


HOLDERS = [H1, H2, I1, I2, I3]


@settings(max_examples=400, deadline=None)
@given(
    instances=st.lists(
        st.tuples(
            st.integers(0, 6),  # queued
            st.sampled_from([100.0, 400.0, 1600.0]),  # prefill tokens/s
            st.sets(st.sampled_from(HOLDERS)),  # links
            st.sampled_from([0.1, 0.99]),  # kv utilization
        ),
        min_size=1,
        max_size=3,
    ),
    blocks=st.lists(st.sets(st.sampled_from(HOLDERS), min_size=1), max_size=4),
    prompt_tokens=st.integers(64, 400),
    max_cost_us=st.sampled_from([float("inf"), 300_000.0]),
)
def test_pruned_scoring_chooses_what_full_scoring_chooses(
    instances: list[tuple[int, float, set[str], float]],
    blocks: list[set[str]],
    prompt_tokens: int,
    max_cost_us: float,
) -> None:
    statuses = [
        status(
            url,
            prefill=rate,
            queued=queued,
            kv_utilization=utilization,
            links=[{"holder": h, "mbit_per_s": 1000, "rtt_us": 50} for h in sorted(links)],
        )
        for url, (queued, rate, links, utilization) in zip((I1, I2, I3), instances, strict=False)
    ]
    answer = lookup([[replica(n, h) for h in sorted(holders)] for n, holders in enumerate(blocks)])
    full = dataclasses.replace(POLICY, max_cost_us=max_cost_us)
    pruned = dataclasses.replace(full, score_all=False)
    want = place(request(4, prompt_tokens), answer, statuses, [], full)
    got = place(request(4, prompt_tokens), answer, statuses, [], pruned)
    assert (got.outcome, got.instance, got.reused_blocks) == (
        want.outcome,
        want.instance,
        want.reused_blocks,
    )
    assert got.chosen == want.chosen
