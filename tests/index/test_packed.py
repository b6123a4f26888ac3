"""Packed records: a block's array rendered from packed tails is the array joined from the
tails themselves, byte for byte, compiled or not; skeletons are shared by like records and freed
with their last one."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.core.records import ReplicaRecord
from kvsp.index import packed
from kvsp.index.keytable import COMPILED, DictKeyTable, KeyTable
from kvsp.index.packed import Skeletons, block_key_of, record_shape, render_array, split_tail
from kvsp.index.wire import identity_middle, identity_prefix, join_array, record_tail
from tests.index.factories import H1, H2, key, replica

TABLES: list[Any] = [DictKeyTable, *([KeyTable] if COMPILED else [])]


def _record(n: int, holder: str, ttl_ms: int, layers: list[bytes] | None) -> ReplicaRecord:
    if layers is None:
        return replica(n, holder=holder, ttl_ms=ttl_ms)
    digest = "sha-256:" + hashlib.sha256(b"".join(layers)).hexdigest()
    return replica(
        n, holder=holder, ttl_ms=ttl_ms, layer_digests=[d.hex() for d in layers], digest=digest
    )


RECORDS = st.builds(
    _record,
    st.integers(0, 1_000),
    st.sampled_from([H1, H2, 'http://127.0.0.1:9/kvsp/a,"b"/']),
    st.integers(1, 10**9),
    st.one_of(st.none(), st.lists(st.binary(min_size=32, max_size=32), min_size=4, max_size=4)),
)


@given(st.lists(RECORDS, min_size=1, max_size=5))
def test_a_rendered_array_is_the_joined_array(records: list[ReplicaRecord]) -> None:
    block = records[0]
    space = (block.compat_id, block.scope_id)
    tails = [record_tail(r, r.ttl_ms) for r in records]
    skeletons = Skeletons()
    payload = b"".join(skeletons.pack(block.block_key, t) for t in tails)
    joined = join_array(identity_prefix(space, block.block_key), tails)
    assert render_array(identity_middle(space), payload, skeletons.listed) == joined
    for table_type in TABLES:
        table = table_type(identity_middle(space), skeletons.listed)
        table.put(block.block_key, 1, payload)
        assert table.join_prefix([block.block_key], b"", b"", b",", b"") == (1, b"1" + joined)


@given(
    st.lists(st.tuples(RECORDS, st.sampled_from([None, 1, 60_000])), min_size=1, max_size=8),
    st.sampled_from(["http://127.0.0.1:9/kvsp/", "x:" + key(7)]),
)
def test_a_record_packs_as_its_tail_does(
    granted: list[tuple[ReplicaRecord, int | None]], other_holder: str
) -> None:
    """Packed once per shape (holder, TTL, residency...), a record is the octets its rendered
    tail packs to, also where another member looks like a digest (a holder ending with 64 hex
    digits after a colon, set past validation: the tail splits more than the digests)."""
    by_record, by_tail = Skeletons(), Skeletons()
    for n, (record, ttl) in enumerate(granted):
        if n % 3 == 2:
            record = record.model_copy(update={"holder": other_holder})
        ttl_ms = record.ttl_ms if ttl is None else ttl
        packed = by_record.pack_record(record, ttl_ms, record_shape(record, ttl_ms))
        assert packed == by_tail.pack(record.block_key, record_tail(record, ttl_ms))
        assert by_record.tail(packed) == record_tail(record, ttl_ms)


def test_the_shapes_remembered_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packed, "MAX_SHAPES", 2)
    skeletons = Skeletons()
    for ttl_ms in range(1, 6):
        record = replica(ttl_ms, ttl_ms=ttl_ms)
        packed_record = skeletons.pack_record(record, ttl_ms, record_shape(record, ttl_ms))
        assert skeletons.tail(packed_record) == record_tail(record, ttl_ms)
        assert len(skeletons._shapes) <= 2


#: pieces of tails: quotes and colons around hex runs of 64 digits and of others
PIECES = st.sampled_from(
    ['"', ":", ",", "sha-256:", key(1), key(2)[:63], key(3).upper(), "x", "\\u0000"]
)


@given(st.lists(PIECES, max_size=30).map("".join))
def test_any_tail_without_a_nul_packs_back_to_itself(text: str) -> None:
    tail = text.encode()
    skeletons = Skeletons()
    packed = skeletons.pack(key(0), tail)
    assert skeletons.tail(packed) == tail
    assert block_key_of(packed) == key(0)


def test_digests_are_cut_only_where_a_json_string_ends() -> None:
    digest = key(1)
    skeleton, digests = split_tail(
        b'"digest":"sha-256:%s","k":"%s","long":"%s0","n":%s}'
        % (digest.encode(), digest.encode(), digest.encode(), digest[:8].encode())
    )
    assert skeleton == b'"digest":"sha-256:\0","k":"\0","long":"%s0","n":%s}' % (
        digest.encode(),
        digest[:8].encode(),
    )
    assert digests == bytes.fromhex(digest) * 2
    with pytest.raises(ValueError, match="NUL"):
        split_tail(b'"a":"\0"}')


def test_like_records_share_a_skeleton_that_goes_with_the_last_of_them() -> None:
    skeletons = Skeletons()
    first, second = (skeletons.pack(key(n), record_tail(replica(n), 1_000)) for n in (1, 2))
    assert len(skeletons) == 1
    assert len(first) == 4 + 32 + 32  # the skeleton's number, the block key and the digest
    other = skeletons.pack(key(3), record_tail(replica(3, holder=H2), 1_000))
    assert len(skeletons) == 2
    skeletons.release(first)
    assert len(skeletons) == 2
    skeletons.release(second)
    assert len(skeletons) == 1
    assert skeletons.listed[0] is None  # freed: a table asked for it refuses
    again = skeletons.pack(key(4), record_tail(replica(4, holder=H1), 1_000))
    assert again[:4] == first[:4]  # the freed number is taken again
    assert skeletons.tail(other) == record_tail(replica(3, holder=H2), 1_000)
