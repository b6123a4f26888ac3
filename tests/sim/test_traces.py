"""Mooncake traces: read as published, reuse as documented, synthetic tokens and Block Keys that
are shared exactly where the trace says a prefix is."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsp.core.ids import parse_compat_id
from kvsp.core.keys import block_keys
from kvsp.core.problems import ConfigurationError
from kvsp.sim.traces import TraceKeys, TraceRequest, block_reuse, load, tokens_of
from tests.conftest import TRACES

SCOPE_KEY = bytes.fromhex("55" * 32)
COMPAT = parse_compat_id("c0" * 32)


@pytest.mark.parametrize(
    ("name", "count", "reuse"),
    [("conversation_trace.jsonl", 12_031, 0.366), ("synthetic_trace.jsonl", 3_993, 0.640)],
)
def test_the_published_traces_and_their_reuse(name: str, count: int, reuse: float) -> None:
    requests = load(TRACES / name)
    assert len(requests) == count
    assert round(block_reuse(requests), 3) == reuse  # the figures of traces/README.md


def test_equal_hash_ids_give_equal_tokens_and_keys() -> None:
    a = TraceRequest(0, 1000, 10, (7, 8))
    b = TraceRequest(5, 700, 10, (7, 9))
    ta, tb = tokens_of(a), tokens_of(b)
    assert (len(ta), len(tb)) == (1000, 700)
    assert ta[:512] == tb[:512]
    assert ta[512:700] != tb[512:700]
    keys = TraceKeys(SCOPE_KEY, COMPAT)
    ka, kb = keys.keys(a), keys.keys(b)
    assert (len(ka), len(kb)) == (1000 // 16, 700 // 16)
    assert ka[:32] == kb[:32]  # the shared 512-token block
    assert ka[32] != kb[32]
    # the memoised chains give what hashing every prompt from scratch gives
    for request, got in ((a, ka), (b, kb)):
        assert got == [k.hex() for k in block_keys(SCOPE_KEY, COMPAT, tokens_of(request), 16)]


def test_real_records_share_their_first_block() -> None:
    first, second = load(TRACES / "conversation_trace.jsonl")[:2]
    keys = TraceKeys(SCOPE_KEY, COMPAT)
    k1, k2 = keys.keys(first), keys.keys(second)
    assert first.hash_ids[0] == second.hash_ids[0]
    assert k1[:32] == k2[:32]
    assert k1[32] != k2[32]


def test_bad_records_are_refused_with_their_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}'
    short = '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}'
    path.write_text(f"{good}\n{short}\n")
    with pytest.raises(ConfigurationError, match="line 2"):
        load(path)
    path.write_text("not json\n")
    with pytest.raises(ConfigurationError, match="line 1"):
        load(path)
    with pytest.raises(ConfigurationError, match="cannot read"):
        load(tmp_path / "missing.jsonl")
