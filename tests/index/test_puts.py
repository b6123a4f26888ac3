"""Split publish batches: a body the splitter takes holds exactly the records the whole parse
finds, one it does not take is parsed whole, and a split batch is stored and authorized as the
same batch parsed whole would be."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp.auth import Principals
from kvsp.core.clock import ManualClock
from kvsp.core.problems import Forbidden, KvspError, RecordError
from kvsp.core.records import MAX_BATCH_ENTRIES, ReplicaBatch, ReplicaRecord
from kvsp.index import puts as puts_module
from kvsp.index.puts import (
    IDENTITY_OCTETS,
    MAX_REMEMBERED,
    MAX_SHAPE_OCTETS,
    RecordShapes,
    split_puts,
)
from kvsp.index.replicas import ReplicaTable
from kvsp.index.rules import IndexLimits
from kvsp.index.service import IndexService
from kvsp.index.stores import MemoryReplicaStore
from tests.index.factories import H1, H2, SCOPE_A, SCOPE_B, key, principals_toml, replica

pytestmark = pytest.mark.skipif(
    split_puts is puts_module._split_nothing, reason="kvsp.index._puts was not built"
)


def body_of(records: list[ReplicaRecord], delete: str = "") -> bytes:
    put = ",".join(r.model_dump_json(exclude_none=True) for r in records)
    return (f'{{"put":[{put}]{delete}}}').encode()


def whole(body: bytes) -> list[ReplicaRecord] | None:
    try:
        return list(ReplicaBatch.parse(body).put)
    except KvspError:
        return None


def split_records(body: bytes) -> list[ReplicaRecord] | None:
    split = RecordShapes().split(body)
    return None if split is None else split.records()


def test_a_holders_batch_is_split_into_one_shape() -> None:
    records = [replica(n) for n in range(64)]
    split = RecordShapes().split(body_of(records, ',"delete":[]'))
    assert split is not None
    assert len(split.identities) == 64 * IDENTITY_OCTETS
    assert [(r.start, r.stop) for r in split.runs] == [(0, 64)]
    assert split.records() == records
    assert split.holders() == [(SCOPE_A, H1)]
    assert split.scope_counts() == {SCOPE_A: 64}


def test_runs_end_where_the_shape_or_the_space_changes() -> None:
    records = [
        replica(0),
        replica(1),
        replica(2, scope=SCOPE_B),
        replica(3, holder=H2, scope=SCOPE_B),
        replica(4, holder=H2, scope=SCOPE_B),
        replica(5),
    ]
    split = RecordShapes().split(body_of(records))
    assert split is not None
    assert [(r.start, r.stop) for r in split.runs] == [(0, 2), (2, 3), (3, 5), (5, 6)]
    assert split.runs[0].shape is split.runs[1].shape is split.runs[3].shape
    assert split.records() == records
    assert split.holders() == [(SCOPE_A, H1), (SCOPE_B, H1), (SCOPE_B, H2)]
    assert split.scope_counts() == {SCOPE_A: 3, SCOPE_B: 3}


def test_shapes_are_remembered_and_forgotten_together() -> None:
    shapes = RecordShapes()
    first = shapes.split(body_of([replica(0)]))
    again = shapes.split(body_of([replica(1)]))
    assert first is not None
    assert again is not None
    assert again.runs[0].shape is first.runs[0].shape  # validated once
    for ttl in range(2, MAX_REMEMBERED + 2):
        assert shapes.split(body_of([replica(0, ttl_ms=ttl)])) is not None
    assert len(shapes._known) <= MAX_REMEMBERED
    later = shapes.split(body_of([replica(2)]))
    assert later is not None
    assert later.records() == [replica(2)]


LAYERED = [hashlib.sha256(b"%d" % i).digest() for i in range(4)]


@pytest.mark.parametrize(
    "body",
    [
        body_of([]),
        b"{}",
        b'{"put":[]}',
        b"[]",
        body_of([replica(0)], ',"delete":[{"x":1}]'),  # withdrawals: parsed whole
        body_of([replica(0)], ',"put":[]'),  # a member twice
        body_of([replica(0)], ',"other":1'),
        body_of([replica(0)]).replace(b'"block_key"', b'"block\\u005fkey"'),
        body_of([replica(0)]).replace(b'"block_key":"', b'"block_key":"\\u0030', 1),
        body_of([replica(0)]).replace(
            b'"scope_id"', b'"scope_id":"%s","scope_id"' % SCOPE_B.encode()
        ),
        body_of([replica(0)]).replace(key(0).encode(), key(0).upper().encode()),
        body_of([replica(0)]).replace(b"sha-256:", b"sha-512:"),
        body_of([replica(0)]).replace(b'"codec":1', b'"codec":7'),  # the shape is not valid
        body_of(
            [
                replica(
                    0,
                    layer_digests=[d.hex() for d in LAYERED],
                    digest="sha-256:" + hashlib.sha256(b"".join(LAYERED)).hexdigest(),
                )
            ]
        ),
        body_of([replica(0)]) + b"x",
        body_of([replica(0)]).replace(
            b'"codec"', b'"pad":"%s","codec"' % (b"x" * MAX_SHAPE_OCTETS)
        ),
        body_of([replica(0)])[:-1],
        body_of([replica(n) for n in range(MAX_BATCH_ENTRIES + 1)]),
    ],
)
def test_what_is_not_split_is_parsed_whole(body: bytes) -> None:
    assert RecordShapes().split(body) is None


def _doc(record: ReplicaRecord, order: list[int], extra: dict[str, Any]) -> dict[str, Any]:
    doc = record.to_json()
    names = list(doc)
    ordered = {names[i % len(names)]: doc[names[i % len(names)]] for i in order}
    return {**ordered, **doc, **extra}


MEMBERS = st.fixed_dictionaries(
    {},
    optional={
        "unknown": st.one_of(st.integers(), st.text(), st.lists(st.booleans())),
        "ttl_ms": st.integers(-1, 2**33),
        "codec": st.sampled_from([1, 2, 7, "1", 1.0]),
        "holder": st.sampled_from([H1, H2, "ftp://x/", 'http://127.0.0.1:9/kvsp/a,"b"\u00e9/']),
        "residency": st.sampled_from(
            [[{"tier": "host", "layers": [0, 3]}], [{"tier": "host", "layers": [3, 0]}], []]
        ),
    },
)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    records = []
    for n in draw(st.lists(st.integers(0, 5), min_size=1, max_size=6)):
        record = replica(n, scope=draw(st.sampled_from([SCOPE_A, SCOPE_B])))
        records.append(_doc(record, draw(st.lists(st.integers(0, 9))), draw(MEMBERS)))
    space = draw(st.sampled_from(["", " ", "\n\t "]))
    text = json.dumps({"put": records}, separators=("," + space, ":" + space))
    return text.encode()


@settings(max_examples=300)
@given(bodies())
def test_a_split_batch_holds_what_the_whole_parse_finds(body: bytes) -> None:
    split = split_records(body)
    if split is not None:
        assert split == whole(body)


@settings(max_examples=500)
@given(bodies(), st.data())
def test_no_mangled_body_is_split_into_other_records(body: bytes, data: st.DataObject) -> None:
    """Octets changed, cut or repeated anywhere: whatever the splitter takes, the whole parse
    takes too, as the same records."""
    at = data.draw(st.integers(0, len(body) - 1))
    end = data.draw(st.integers(at, min(len(body), at + 80)))
    middle = data.draw(
        st.one_of(
            st.binary(max_size=4),
            st.sampled_from([b'"', b"\\", b"{", b"}", b"[", b"]", b",", b":", b'\\"', b"\x00"]),
            st.just(body[at:end] * 2),
        )
    )
    mangled = body[:at] + middle + body[end:]
    split = split_records(mangled)
    if split is not None:
        assert split == whole(mangled)


def test_a_split_batch_is_stored_as_the_whole_batch() -> None:
    """Same records, new blocks and refreshes and a second holder of a block: the same
    answers, outcomes and counts."""
    first = [replica(n) for n in range(8)]
    second = [
        *(replica(n, ttl_ms=90_000) for n in [8, 4, 9, 10, 5, 11, 11, 6]),  # new, held, twice
        replica(2, holder=H2),
        replica(3, scope=SCOPE_B),
    ]
    shapes = RecordShapes()
    limits = IndexLimits(max_ttl_ms=60_000)
    split_table, whole_table = (
        ReplicaTable(ManualClock(), limits),
        ReplicaTable(ManualClock(), limits),
    )
    for batch in (first, second):
        split = shapes.split(body_of(batch))
        assert split is not None
        assert split_table.publish_shared(split) == whole_table.publish_many(batch)
    asked = [key(n) for n in range(13)]
    assert split_table.answer(first[0].compat_id, SCOPE_A, asked) == whole_table.answer(
        first[0].compat_id, SCOPE_A, asked
    )
    assert (
        split_table.counts_by_scope() == whole_table.counts_by_scope() == {SCOPE_A: 13, SCOPE_B: 1}
    )
    assert len(split_table._deadlines) == len(whole_table._deadlines)


def test_a_table_that_renders_nothing_stores_the_records() -> None:
    records = [replica(n) for n in range(3)]
    split = RecordShapes().split(body_of(records))
    assert split is not None
    table = ReplicaTable(ManualClock(), IndexLimits(), render_at_publish=False)
    table.publish_shared(split)
    assert [
        b.replicas[0].record
        for b in table.lookup(records[0].compat_id, SCOPE_A, [key(0), key(1), key(2)])
    ] == records


def test_a_shape_with_another_digest_is_packed_record_by_record() -> None:
    """A member of 64 hex digits other than the digests (here in the holder URL) is no hole of
    the skeleton: such records are stored one by one, rendered as published."""
    holder = f"http://127.0.0.1:9/kvsp/{key(99)}/"
    records = [replica(n, holder=holder) for n in range(3)]
    split = RecordShapes().split(body_of(records))
    assert split is not None
    table = ReplicaTable(ManualClock(), IndexLimits())
    table.publish_shared(split)
    _, answer = table.answer(records[0].compat_id, SCOPE_A, [key(0), key(1), key(2)])
    assert [r[0]["holder"] for r in json.loads(answer)["replicas"]] == [holder] * 3


def test_a_split_batch_past_the_limit_stores_nothing() -> None:
    table = ReplicaTable(ManualClock(), IndexLimits(max_records=4))
    split = RecordShapes().split(body_of([replica(n) for n in range(3)]))
    assert split is not None
    table.publish_shared(split)
    more = RecordShapes().split(body_of([replica(n) for n in range(1, 5)]))  # two new
    assert more is not None
    with pytest.raises(KvspError):
        table.publish_shared(more)
    assert table.count == 3
    refresh = RecordShapes().split(body_of([replica(n) for n in range(4)]))  # one new
    assert refresh is not None
    table.publish_shared(refresh)
    assert table.count == 4


@pytest.mark.anyio
async def test_a_split_batch_is_authorized_and_bounded_as_a_whole_one() -> None:
    principals = Principals.parse(principals_toml())
    holder = principals.authenticate("Bearer h1")
    service = IndexService(MemoryReplicaStore(ManualClock(), IndexLimits()), max_layers=8)
    answer = json.loads(await service.batch_body(holder, body_of([replica(0), replica(1)])))
    assert [p["created"] for p in answer["put"]] == [True, True]
    for refused, error in (
        (body_of([replica(2), replica(3, holder=H2)]), Forbidden),
        (body_of([replica(4, scope=SCOPE_B)]), Forbidden),
        (body_of([replica(5, residency=[{"tier": "host", "layers": [0, 8]}])]), RecordError),
    ):
        with pytest.raises(error):
            await service.batch_body(holder, refused)
    assert await service.store.counts_by_scope() == {SCOPE_A: 2}
