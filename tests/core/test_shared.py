"""Shared public prefixes (KVSP 4.2): which blocks are keyed in the shared scope, and how the
tenant's chain continues from the last shared key."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp.core.ids import CompatId, parse_block_key
from kvsp.core.keys import ROOT_PARENT, block_keys, scope_id
from kvsp.core.shared import ScopedChain, SharedScope, scope_runs, shared_blocks

COMPAT = CompatId(bytes(range(32)))
TENANT_KEY, SHARED_KEY = b"t" * 32, b"s" * 32
TENANT, SHARED = scope_id(TENANT_KEY).hex(), scope_id(SHARED_KEY).hex()
B = 4
PREFIX = tuple(range(100, 114))  # 3 whole blocks of 4, and 2 tokens not shared
PUBLIC = SharedScope("system", SHARED_KEY, SHARED, PREFIX)


def chain(*shared: SharedScope) -> ScopedChain:
    return ScopedChain(TENANT_KEY, TENANT, COMPAT, B, shared)


def test_without_a_shared_prefix_it_is_the_plain_chain() -> None:
    tokens = list(range(30))
    assert chain().extend(tokens) == block_keys(TENANT_KEY, COMPAT, tokens, B)
    assert chain(PUBLIC).extend(tokens) == block_keys(TENANT_KEY, COMPAT, tokens, B)


def test_the_prefix_blocks_are_the_shared_scopes_and_the_rest_continues_from_them() -> None:
    tokens = [*PREFIX, 7, 7, 8, 8, 9, 9]
    scoped = chain(PUBLIC)
    keys = scoped.extend(tokens)
    shared = block_keys(SHARED_KEY, COMPAT, PREFIX, B)
    assert keys[:3] == shared  # what every tenant allowed computes
    assert keys[3:] == block_keys(TENANT_KEY, COMPAT, tokens[12:], B, parent=shared[-1])
    assert (scoped.shared, scoped.shared_count) == (PUBLIC, 3)
    assert [scoped.scope_of(i) for i in range(5)] == [SHARED] * 3 + [TENANT] * 2


def test_a_prompt_that_leaves_the_prefix_early_shares_only_the_blocks_before() -> None:
    tokens = [*PREFIX[:4], 0, 0, 0, 0, *PREFIX[8:12]]  # block 1 differs: block 2 is not shared
    scoped = chain(PUBLIC)
    keys = scoped.extend(tokens)
    first = block_keys(SHARED_KEY, COMPAT, PREFIX[:4], B)
    assert keys[0] == first[0]
    assert keys[1:] == block_keys(TENANT_KEY, COMPAT, tokens[4:], B, parent=first[0])
    assert scoped.shared_count == 1


def test_a_different_first_block_never_touches_the_shared_scope() -> None:
    scoped = chain(PUBLIC)
    scoped.extend([1, *PREFIX[1:]])
    assert scoped.shared is None
    assert scoped.shared_count == 0
    assert scoped.scope_of(0) == TENANT


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(0, 3), max_size=30).map(lambda tail: [*PREFIX[:12], *tail]),
    st.integers(0, 42),
    st.integers(1, 9),
)
def test_fed_in_pieces_or_resumed_from_its_keys_it_gives_the_same_keys(
    tokens: list[int], cut: int, step: int
) -> None:
    """Extending in any pieces, or starting again after some whole blocks from their keys only
    (a checkpoint), gives the same keys and scopes as one pass."""
    whole = chain(PUBLIC)
    expected = whole.extend(tokens)
    pieces = chain(PUBLIC)
    got = []
    for start in range(0, len(tokens), step):
        got += pieces.extend(tokens[start : start + step])
    assert got == expected
    blocks = min(cut, len(expected))
    given_keys = [k.hex() for k in expected[:blocks]]
    scope, count = shared_blocks([PUBLIC], given_keys, COMPAT, B)
    after = ScopedChain(
        TENANT_KEY, TENANT, COMPAT, B, [PUBLIC],
        parent=parse_block_key(given_keys[-1]) if given_keys else ROOT_PARENT,
        blocks=blocks, shared=scope, shared_count=count,
    )  # fmt: skip
    assert after.extend(tokens[blocks * B :]) == expected[blocks:]
    assert [after.scope_of(i) for i in range(len(expected))] == [
        whole.scope_of(i) for i in range(len(expected))
    ]


def test_of_two_prefixes_the_first_block_chooses() -> None:
    other = SharedScope("other", b"o" * 32, scope_id(b"o" * 32).hex(), (1, 2, 3, 4, 5, 6, 7, 8))
    scoped = chain(PUBLIC, other)
    keys = scoped.extend([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert keys == block_keys(b"o" * 32, COMPAT, [1, 2, 3, 4, 5, 6, 7, 8], B)
    assert scoped.shared == other


def test_scope_runs_cut_a_sequence_where_its_scope_changes() -> None:
    scoped = chain(PUBLIC)
    scoped.extend([*PREFIX, 7, 7, 8, 8, 9, 9])
    assert scope_runs(["k2", "k3", "k4"], scoped.scope_of, 2) == [
        (SHARED, ["k2"]),
        (TENANT, ["k3", "k4"]),
    ]
    assert scope_runs([], scoped.scope_of) == []
