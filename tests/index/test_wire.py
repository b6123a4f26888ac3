"""The octets the IS serves: record tails, block arrays, answers and packed keys, each read
back to what was written."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.core.records import ReplicaRecord
from kvsp.index.wire import (
    PackedKeys,
    answer_json,
    batch_json,
    identity_prefix,
    join_array,
    record_tail,
)
from tests.index.factories import (
    H1,
    H2,
    I1,
    I2,
    keys,
    replica,
)


def test_packed_keys_read_as_the_hex_keys_they_pack() -> None:
    hexes = keys(0, 1, 2)
    packed = PackedKeys(b"".join(bytes.fromhex(k) for k in hexes))
    assert len(packed) == 3
    assert list(packed) == hexes
    assert (packed[0], packed[-1], packed[::2]) == (hexes[0], hexes[2], hexes[::2])
    assert hexes[1] in packed
    with pytest.raises(IndexError):
        packed[3]
    with pytest.raises(IndexError):
        packed[-4]


RECORDS = st.builds(
    replica,
    st.integers(0, 1_000),
    holder=st.sampled_from([H1, H2, I1, I2, 'http://127.0.0.1:9/kvsp/a,"b"/']),
    ttl_ms=st.integers(1, 10**9),
)


@given(RECORDS, st.integers(1, 10**9))
def test_a_record_is_its_identity_prefix_and_its_tail(record: ReplicaRecord, ttl: int) -> None:
    """Prefix + tail is the record's served JSON, byte for byte, with the granted TTL."""
    granted = record.model_copy(update={"ttl_ms": ttl})
    prefix = identity_prefix((record.compat_id, record.scope_id), record.block_key)
    served = prefix + record_tail(record, ttl)
    assert served == granted.model_dump_json(by_alias=True, exclude_none=True).encode()
    assert ReplicaRecord.parse(served) == granted


@given(st.lists(RECORDS, min_size=1, max_size=6), st.integers(0, 3))
def test_a_block_array_holds_its_records_and_answers_hold_the_arrays(
    records: list[ReplicaRecord], estimates: int
) -> None:
    block = records[0]
    prefix = identity_prefix((block.compat_id, block.scope_id), block.block_key)
    same_block = [r.model_copy(update={"block_key": block.block_key}) for r in records]
    tails = [record_tail(r, r.ttl_ms) for r in same_block]
    array = join_array(prefix, tails)
    assert [ReplicaRecord.parse(json.dumps(r)) for r in json.loads(array)] == same_block
    rendered = ",".join(json.dumps({"target": H1, "fetch_us": n}) for n in range(estimates))
    answer = json.loads(answer_json([array, array], rendered.encode()))
    assert answer["matched"] == 2
    assert answer["replicas"] == [json.loads(array)] * 2
    assert [e["fetch_us"] for e in answer["estimates"]] == list(range(estimates))
    assert json.loads(answer_json([])) == {"matched": 0, "replicas": [], "estimates": []}


@given(
    st.lists(st.tuples(st.booleans(), st.integers(1, 2**32 - 1)), max_size=20),
    st.lists(st.booleans(), max_size=20),
)
def test_a_batch_answer_reads_back_as_each_entrys_outcome(
    published: list[tuple[bool, int]], withdrawn: list[bool]
) -> None:
    doc = json.loads(batch_json(published, withdrawn))
    assert doc == {
        "put": [{"created": created, "ttl_ms": ttl} for created, ttl in published],
        "delete": [{"withdrawn": w} for w in withdrawn],
    }
