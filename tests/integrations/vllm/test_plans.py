"""The connector's per-request planning, without vLLM: keys, what to look up, load, save."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvsp.core.ids import parse_compat_id
from kvsp.core.keys import block_keys, scope_id
from kvsp.core.problems import ConfigurationError, InvalidInput
from kvsp.core.records import ReplicaRecord
from kvsp.core.shared import SharedScope
from kvsp.integrations.vllm.plans import (
    BlockLoad,
    RequestPlan,
    TrackedRequest,
    check_block_sizes,
    fetch_ranges,
    matchable_tokens,
)
from kvsp.tenants import Tenant
from tests.index.factories import COMPAT, replica

SCOPE_KEY = bytes.fromhex("33" * 32)
TOKENS = list(range(500, 600))  # 6 whole blocks of 16 and 4 tokens


TENANT = Tenant("t", SCOPE_KEY, scope_id(SCOPE_KEY).hex(), frozenset({COMPAT}))


def tracked(given: tuple[str, ...] = ()) -> TrackedRequest:
    return TrackedRequest.start(TENANT, parse_compat_id(COMPAT), 16, given)


def expected_keys(tokens: list[int]) -> list[str]:
    return [k.hex() for k in block_keys(SCOPE_KEY, parse_compat_id(COMPAT), tokens, 16)]


def test_keys_are_the_block_keys_of_the_tokens_fed_so_far() -> None:
    t = tracked()
    assert t.keys(TOKENS[:40]) == expected_keys(TOKENS[:40])
    assert t.keys(TOKENS) == expected_keys(TOKENS)  # extended, earlier blocks not rehashed


def test_what_may_come_from_outside_stops_before_the_last_token() -> None:
    assert matchable_tokens(97, 16) == 96
    assert matchable_tokens(96, 16) == 80  # the last token is always computed
    assert matchable_tokens(1, 16) == matchable_tokens(0, 16) == 0
    t = tracked()
    keys = expected_keys(TOKENS)
    assert t.wanted(TOKENS, 0) == keys[:6]
    assert t.wanted(TOKENS, 32) == keys[2:6]
    assert t.wanted(TOKENS[:33], 32) == []


def test_loads_come_once_then_completed_blocks_are_saved_as_tokens_arrive() -> None:
    t = tracked()
    keys = expected_keys(TOKENS)
    records = (replica(1),)
    t.lookup = (32, tuple(BlockLoad(k, 0, records) for k in keys[2:6]))
    t.allocated(32, 48)  # three of the four matched blocks fit vLLM's room
    loads, saves = t.step(TOKENS, 100)
    assert [(x.key, x.first_token) for x in loads] == [(keys[2], 32), (keys[3], 48), (keys[4], 64)]
    assert [(x.key, x.first_token) for x in saves] == [(keys[5], 80)]  # 80..95 computed now
    assert t.loaded_tokens == 48
    assert t.step(TOKENS, 100) == ((), [])  # nothing twice
    more = [*TOKENS, *range(7, 19)]  # decoding: block 6 completes at token 112
    assert t.step(more, 111) == ((), [])
    _, saves = t.step(more, 112)
    assert [(x.key, x.first_token) for x in saves] == [(expected_keys(more)[6], 96)]


def test_a_resumed_prefix_keeps_its_given_keys_and_is_never_saved() -> None:
    given = tuple(expected_keys(TOKENS)[:2])
    t = tracked(given)
    placeholders = [0] * 32 + TOKENS[32:]
    assert t.keys(placeholders) == expected_keys(TOKENS)  # chained on the last given key
    _, saves = t.step(placeholders, 100)
    assert [x.first_token for x in saves] == [32, 48, 64, 80]


def test_malformed_prefix_keys_are_refused() -> None:
    with pytest.raises(InvalidInput):
        tracked(("zz" * 32,))
    with pytest.raises(InvalidInput):
        tracked((expected_keys(TOKENS)[0], "ab"))


def test_a_failed_load_counts_only_what_precedes_it_and_saves_the_rest_again() -> None:
    t = tracked()
    keys = expected_keys(TOKENS)
    t.lookup = (0, tuple(BlockLoad(k, 0, (replica(1),)) for k in keys))
    t.allocated(0, 96)
    t.step(TOKENS, 100)
    t.load_failed([7, 8], {8}, 64)  # vLLM's second page (tokens 64..127) failed
    assert t.loaded_tokens == 64
    _, saves = t.step(TOKENS, 100)
    assert [x.first_token for x in saves] == [64, 80]


def test_fetch_ranges_follow_the_holders_tiers_and_the_chunk() -> None:
    doc = replica(1).model_dump()
    doc["residency"] = [
        {"tier": "disk", "layers": (10, 29), "read_mbit_per_s": 1000},
        {"tier": "host", "layers": (0, 9), "read_mbit_per_s": 9000},
    ]
    record = ReplicaRecord.model_validate(doc)
    assert fetch_ranges(record, 0, 0) == [(0, 9), (10, 29)]
    assert fetch_ranges(record, 12, 0) == [(12, 29)]
    assert fetch_ranges(record, 0, 8) == [(0, 7), (8, 9), (10, 17), (18, 25), (26, 29)]


def test_page_positions_and_block_sizes() -> None:
    plan = RequestPlan("r", COMPAT, (4, 9, 2))
    assert plan.page_of(0, 128) == (4, 0)
    assert plan.page_of(144, 128) == (9, 16)
    check_block_sizes(16, 128)
    with pytest.raises(ConfigurationError, match="multiple"):
        check_block_sizes(48, 128)


def test_the_blocks_of_a_shared_prefix_are_saved_in_its_scope() -> None:
    shared = SharedScope("system", b"s" * 32, scope_id(b"s" * 32).hex(), tuple(TOKENS[:32]))
    tenant = replace(TENANT, shared=(shared,))
    t = TrackedRequest.start(tenant, parse_compat_id(COMPAT), 16)
    _, saves = t.step(TOKENS, len(TOKENS))
    assert [s.scope_id for s in saves] == [shared.scope_id] * 2 + [TENANT.scope_id] * 4
    assert [s.key for s in saves[:2]] == shared.keys(parse_compat_id(COMPAT), 16)


def test_full_pages_are_reported_once_each_with_their_blocks_in_order() -> None:
    shared = SharedScope("system", b"s" * 32, scope_id(b"s" * 32).hex(), tuple(TOKENS[:32]))
    t = TrackedRequest.start(replace(TENANT, shared=(shared,)), parse_compat_id(COMPAT), 16)
    keys = t.keys(TOKENS)
    assert t.full_pages(TOKENS, 0, 32) == []  # vLLM hashed no page yet
    first = t.full_pages(TOKENS, 1, 32)
    assert first == [(0, [(shared.scope_id, keys[0]), (shared.scope_id, keys[1])])]
    rest = t.full_pages(TOKENS, 9, 32)  # 100 tokens: 3 full pages, whatever vLLM hashed
    assert rest == [
        (1, [(TENANT.scope_id, keys[2]), (TENANT.scope_id, keys[3])]),
        (2, [(TENANT.scope_id, keys[4]), (TENANT.scope_id, keys[5])]),
    ]
    assert t.full_pages(TOKENS, 9, 32) == []


def test_a_resumed_prefix_s_pages_carry_the_given_keys() -> None:
    given = tuple(expected_keys(TOKENS)[:2])
    t = tracked(given)
    placeholders = [0] * 32 + TOKENS[32:64]
    assert t.full_pages(placeholders, 2, 32) == [
        (0, [(TENANT.scope_id, given[0]), (TENANT.scope_id, given[1])]),
        (1, [(TENANT.scope_id, k) for k in expected_keys(TOKENS[:64])[2:4]]),
    ]
