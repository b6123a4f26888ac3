"""Lookup bodies: ``decode_lookup`` accepts exactly what ``LookupRequest`` accepts, and means the
same by it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvsp.core.problems import RecordError
from kvsp.core.records import MAX_KEYS_PER_REQUEST, LookupRequest
from kvsp.index.queries import Lookup, decode_lookup
from tests.index.factories import COMPAT, SCOPE_A, key

HEXISH = st.text(alphabet="0123456789abcdefABCDEF g\n", min_size=0, max_size=70)
ids32 = st.one_of(st.just(SCOPE_A), st.just(SCOPE_A), HEXISH, st.integers(), st.none())
ids64 = st.one_of(st.just(COMPAT), st.just(COMPAT), st.just(COMPAT.upper()), HEXISH)
block_key = st.one_of(
    st.builds(key, st.integers(0, 1000)),
    st.builds(lambda k: k + "\n", st.builds(key, st.integers(0, 9))),
    HEXISH,
    st.integers(),
    st.none(),
)
block_keys = st.one_of(
    st.lists(st.builds(key, st.integers(0, 1000)), max_size=8),
    st.lists(block_key, max_size=5),
    st.just("not a list"),
)
targets = st.one_of(
    st.none(),
    st.lists(st.sampled_from(["http://127.0.0.1:9201/kvsp/", "not a url", "ftp://x/"]), max_size=3),
    st.just([3]),
)
block_tokens = st.one_of(
    st.none(),
    st.integers(-2, 3),
    st.just(1 << 20),
    st.just((1 << 20) + 1),
    st.just(1.0),
    st.just(True),
    st.just("16"),
    st.just(10**30),
)
answers = st.sampled_from(["holders", "replicas", None, 3, "HOLDERS"])


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for name, values in (
        ("scope_id", ids32),
        ("compat_id", ids64),
        ("block_keys", block_keys),
        ("targets", targets),
        ("block_tokens", block_tokens),
        ("answer", answers),
        ("unknown", st.integers()),
    ):
        if draw(st.booleans()) or name in ("scope_id", "compat_id", "block_keys"):
            doc[name] = draw(values)
    return doc


def meaning(query: Any) -> tuple[Any, ...]:
    return (
        query.scope_id,
        query.compat_id,
        tuple(query.block_keys),
        None if query.targets is None else tuple(str(t) for t in query.targets),
        query.block_tokens,
        query.answer,
    )


def encode(doc: dict[str, Any], style: str) -> bytes:
    """The same document written compactly, spread over lines, or with a key's first ``a``
    as a JSON escape (the same string once decoded)."""
    if style == "indent":
        return json.dumps(doc, indent=2).encode()
    text = json.dumps(doc, separators=(",", ":"))
    if style == "escaped":
        text = text.replace('a"', '\\u0061"', 1)
    return text.encode()


@settings(max_examples=500)
@given(bodies(), st.sampled_from(["compact", "indent", "escaped"]))
def test_decode_lookup_agrees_with_the_record_model(doc: dict[str, Any], style: str) -> None:
    body = encode(doc, style)
    try:
        expected: tuple[Any, ...] | None = meaning(LookupRequest.parse(body))
    except RecordError:
        expected = None
    try:
        got: tuple[Any, ...] | None = meaning(decode_lookup(body))
    except RecordError:
        got = None
    event("accepted" if expected is not None else "refused")
    assert got == expected


def test_a_body_without_targets_is_decoded_without_the_model() -> None:
    body = json.dumps({"scope_id": SCOPE_A, "compat_id": COMPAT, "block_keys": [key(0)]})
    query = decode_lookup(body.encode())
    assert isinstance(query, Lookup)
    assert meaning(query) == (SCOPE_A, COMPAT, (key(0),), None, None, None)
    with_targets = json.dumps(
        {"scope_id": SCOPE_A, "compat_id": COMPAT, "block_keys": [], "targets": []}
    )
    assert isinstance(decode_lookup(with_targets.encode()), LookupRequest)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"[]",
        b"{",
        b"\xff",
        json.dumps({"scope_id": SCOPE_A, "compat_id": COMPAT}).encode(),
        json.dumps(
            {"scope_id": SCOPE_A, "compat_id": COMPAT, "block_keys": [key(0)] * 2 + ["x"]}
        ).encode(),
        json.dumps(
            {
                "scope_id": SCOPE_A,
                "compat_id": COMPAT,
                "block_keys": [key(0)] * (MAX_KEYS_PER_REQUEST + 1),
            }
        ).encode(),
    ],
)
def test_malformed_bodies_are_record_errors(body: bytes) -> None:
    with pytest.raises(RecordError):
        LookupRequest.parse(body)
    with pytest.raises(RecordError, match="LookupRequest"):
        decode_lookup(body)


def test_keys_written_with_escapes_or_spread_over_lines_mean_the_same() -> None:
    keys = [key(n) for n in range(3)]
    plain = {"scope_id": SCOPE_A, "compat_id": COMPAT, "block_keys": keys}
    escaped = json.dumps(plain).replace(keys[1], f"\\u{ord(keys[1][0]):04x}{keys[1][1:]}")
    assert "\\u00" in escaped
    for body in (json.dumps(plain), json.dumps(plain, indent=4), escaped):
        query = decode_lookup(body.encode())
        assert list(query.block_keys) == keys
        assert query.block_keys[1] == keys[1]
        assert query.block_keys[-1] == keys[2]
        assert query.block_keys[1:] == keys[1:]


@pytest.mark.parametrize("count", [2, 64, 700])  # keys past the compiled check's stack set
def test_a_key_asked_twice_is_refused_however_it_is_written(count: int) -> None:
    keys = [key(n) for n in range(count)]
    for repeated, spacing in (([*keys, keys[count // 2]], ","), ([*keys, keys[0]], ", ")):
        listed = spacing.join(f'"{k}"' for k in repeated)
        body = f'{{"scope_id":"{SCOPE_A}","compat_id":"{COMPAT}","block_keys":[{listed}]}}'
        with pytest.raises(RecordError, match="appears twice"):
            decode_lookup(body.encode())
    distinct = {"scope_id": SCOPE_A, "compat_id": COMPAT, "block_keys": keys}
    assert len(decode_lookup(json.dumps(distinct).encode()).block_keys) == count
