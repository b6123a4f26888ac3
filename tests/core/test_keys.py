"""Scope IDs and the Block Key chain: validation, incremental extension, input forms."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.core.keys import BlockKeyChain, block_keys, scope_id, token_octets
from kvsp.core.problems import KeyMaterialError

KEY = bytes(range(32))
COMPAT = bytes(32)


def test_scope_key_must_have_32_octets() -> None:
    with pytest.raises(KeyMaterialError, match="at least 32 octets, got 31"):
        scope_id(bytes(31))
    with pytest.raises(KeyMaterialError, match="at least 32"):
        BlockKeyChain(bytes(16), COMPAT, 16)  # type: ignore[arg-type]
    assert len(scope_id(bytes(64))) == 16


@pytest.mark.parametrize("bad", [[-1], [2**32], [1, 2, 2**40]])
def test_token_ids_outside_uint32_are_errors(bad: list[int]) -> None:
    with pytest.raises(KeyMaterialError, match=r"0\.\.2\^32-1"):
        block_keys(KEY, COMPAT, bad, 1)  # type: ignore[arg-type]
    with pytest.raises(KeyMaterialError, match=r"0\.\.2\^32-1"):
        block_keys(KEY, COMPAT, np.array(bad, dtype=np.int64), 1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("dtype", "values", "ok"),
    [
        (np.int8, [-1], False),
        (np.int16, [32767], True),
        (np.int32, [-5], False),
        (np.int32, [2**31 - 1], True),
        (np.uint32, [2**32 - 1], True),
        (np.uint64, [2**32], False),
        (np.uint64, [2**32 - 1], True),
        (np.int64, [2**32 - 1, 0], True),
    ],
)
def test_array_range_check_for_every_integer_width(
    dtype: type[np.integer], values: list[int], ok: bool
) -> None:
    array = np.array(values, dtype=dtype)
    if ok:
        assert bytes(token_octets(array)) == b"".join(v.to_bytes(4, "big") for v in values)
    else:
        with pytest.raises(KeyMaterialError):
            token_octets(array)


@pytest.mark.parametrize(
    "bad", ["123", b"\x00\x01", [1.5], [None], np.array([1.0]), np.zeros((2, 2), np.int64)]
)
def test_token_input_must_be_integers(bad: object) -> None:
    with pytest.raises(KeyMaterialError):
        token_octets(bad)  # type: ignore[arg-type]


def test_list_and_array_inputs_agree() -> None:
    tokens = list(range(100))
    assert block_keys(KEY, COMPAT, tokens, 16) == block_keys(  # type: ignore[arg-type]
        KEY,
        COMPAT,  # type: ignore[arg-type]
        np.array(tokens, dtype=np.uint32),
        16,
    )


def test_only_complete_blocks_have_keys() -> None:
    assert block_keys(KEY, COMPAT, list(range(15)), 16) == []  # type: ignore[arg-type]
    assert len(block_keys(KEY, COMPAT, list(range(47)), 16)) == 2  # type: ignore[arg-type]


def test_keys_name_the_whole_prefix() -> None:
    a = block_keys(KEY, COMPAT, [1, 2, 3, 4], 2)  # type: ignore[arg-type]
    b = block_keys(KEY, COMPAT, [9, 9, 3, 4], 2)  # type: ignore[arg-type]
    assert a[0] != b[0]
    assert a[1] != b[1]  # same second block, different prefix
    other_scope = block_keys(bytes(32), COMPAT, [1, 2, 3, 4], 2)  # type: ignore[arg-type]
    assert set(a).isdisjoint(other_scope)


@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=200),
    st.lists(st.integers(0, 40), max_size=20),
    st.integers(1, 17),
)
def test_incremental_chain_equals_one_shot(tokens: list[int], cuts: list[int], block: int) -> None:
    chain = BlockKeyChain(KEY, COMPAT, block)  # type: ignore[arg-type]
    produced = []
    pos = 0
    for cut in cuts:
        produced += chain.extend(tokens[pos : pos + cut])
        pos += cut
    produced += chain.extend(tokens[pos:])
    expected = block_keys(KEY, COMPAT, tokens, block)  # type: ignore[arg-type]
    assert produced == expected
    assert chain.keys == expected
    assert chain.pending_tokens == len(tokens) % block


def test_decode_completes_one_block_at_a_time() -> None:
    chain = BlockKeyChain(KEY, COMPAT, 4)  # type: ignore[arg-type]
    assert chain.extend([1, 2, 3]) == []
    assert len(chain.extend([4])) == 1
    for token in (5, 6, 7):
        assert chain.extend([token]) == []
    assert chain.extend(np.array([8], dtype=np.int64)) == [chain.keys[1]]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((KEY, bytes(31), 4), "compat id"),
        ((KEY, COMPAT, 0), "block_tokens"),
        ((KEY, COMPAT, 4, bytes(5)), "parent"),
        (("k" * 40, COMPAT, 4), "octets"),
    ],
)
def test_chain_arguments(args: tuple[object, ...], message: str) -> None:
    with pytest.raises(KeyMaterialError, match=message):
        BlockKeyChain(*args)  # type: ignore[arg-type]
