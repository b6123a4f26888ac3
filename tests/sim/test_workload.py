"""Workloads: replayed traces keep the trace's sharing within a tenant and none across tenants;
generated sessions grow turn by turn over shared system prompts."""

from __future__ import annotations

import itertools

import pytest

from kvsp.core.ids import parse_compat_id
from kvsp.core.problems import ConfigurationError
from kvsp.sim.traces import TraceRequest
from kvsp.sim.workload import agentic, from_trace, shared_prefix

COMPAT = parse_compat_id("c0" * 32)
TRACE = [
    TraceRequest(0, 1_100, 10, (1, 2, 3)),  # 2 whole blocks + a cut one
    TraceRequest(1_000, 1_600, 20, (1, 2, 4, 5)),  # turn 2: extends the first's whole blocks
    TraceRequest(2_000, 600, 5, (1, 6)),  # shares only the first block: a new session
]


def test_a_trace_replay_keeps_its_sharing_and_sessions() -> None:
    first, second, third = from_trace(TRACE, COMPAT, 512)
    assert [r.arrival_ms for r in (first, second, third)] == [0, 1_000, 2_000]
    assert (len(first.keys), len(second.keys), len(third.keys)) == (2, 3, 1)
    assert second.keys[:2] == first.keys
    assert third.keys[0] == first.keys[0]
    assert second.session == first.session
    assert third.session != first.session
    assert (first.prompt_tokens, first.output_tokens) == (1_100, 10)


def test_copies_are_tenants_sharing_nothing_and_spread_in_time() -> None:
    requests = from_trace(TRACE, COMPAT, 512, copies=2, rate_scale=2.0)
    assert len(requests) == 6
    assert [r.arrival_ms for r in requests] == sorted(r.arrival_ms for r in requests)
    by_tenant = {t: [r for r in requests if r.tenant == t] for t in (0, 1)}
    keys = [{k for r in by_tenant[t] for k in r.keys} for t in (0, 1)]
    assert not keys[0] & keys[1]
    # the second copy is shifted by half the trace's duration (wrapping), at twice the speed
    shifted = sorted((t + 2_001 / 2) % 2_001 / 2 for t in (0, 1_000, 2_000))
    assert sorted(r.arrival_ms for r in by_tenant[1]) == pytest.approx(shifted)
    assert from_trace(TRACE, COMPAT, 512, limit=2)[-1].arrival_ms == 1_000
    with pytest.raises(ConfigurationError):
        from_trace(TRACE, COMPAT, 512, copies=0)


def test_agentic_turns_extend_their_session_over_a_shared_system_prompt() -> None:
    requests = agentic(COMPAT, 16, sessions=5, system_tokens=64, tenants=1, seed=3)
    sessions: dict[str, list] = {}
    for r in requests:
        sessions.setdefault(r.session, []).append(r)
    assert len(sessions) == 5
    system = requests[0].keys[:4]
    for turns in sessions.values():
        assert all(t.keys[:4] == system for t in turns)
        for a, b in itertools.pairwise(turns):
            assert b.keys[: len(a.keys)] == a.keys  # the next prompt extends this one
            assert b.prompt_tokens > a.prompt_tokens + a.output_tokens - 1
            assert b.arrival_ms > a.arrival_ms
        assert turns[-1].last
        assert not turns[-1].tool_call
        assert not any(t.last for t in turns[:-1])
    assert agentic(COMPAT, 16, sessions=5, system_tokens=64, seed=3) == requests


def test_shared_prefix_groups_share_their_system_prompt_only() -> None:
    requests = shared_prefix(COMPAT, 16, groups=3, prompts_per_group=4, system_tokens=64)
    assert len(requests) == 12
    groups: dict[str, set[tuple[str, ...]]] = {}
    for r in requests:
        groups.setdefault(r.session.split("-")[0], set()).add(tuple(r.keys[:4]))
    assert all(len(prefixes) == 1 for prefixes in groups.values())
    assert len({next(iter(p)) for p in groups.values()}) == 3
