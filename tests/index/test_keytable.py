"""The block-key table, compiled and its pure-Python fallback, against a dict model: every
operation, malformed keys, growth, deletion inside probe runs, and the answer it assembles."""

from __future__ import annotations

import gc
import hashlib
import subprocess
import sys
import weakref
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp.index import keytable
from kvsp.index.keytable import COMPILED, DictKeyTable, KeyTable, check_keys, is_hex, untrack
from kvsp.index.packed import Skeletons
from kvsp.index.wire import identity_middle
from tests.conftest import ROOT

#: each implementation: its table, and its key checks (the compiled one where it was built)
IMPLEMENTATIONS: dict[str, tuple[Any, Any, Any]] = {
    "fallback": (DictKeyTable, keytable._check_keys, keytable._is_hex),
}
if COMPILED:
    IMPLEMENTATIONS["compiled"] = (KeyTable, check_keys, is_hex)
both = pytest.mark.parametrize("impl", sorted(IMPLEMENTATIONS))


def key(n: int) -> str:
    return hashlib.sha256(b"%d" % n).hexdigest()


class Value:
    """A value whose identity the table must keep."""

    def __init__(self, n: int) -> None:
        self.n = n


#: the skeletons every table of these tests renders from, and its identity members
SKELETONS = Skeletons()
IDENTITY = identity_middle(("compat", "scope"))


def table_of(impl: str) -> Any:
    return IMPLEMENTATIONS[impl][0](IDENTITY, SKELETONS.listed)


def packed(n: int, k: str | None = None) -> bytes:
    """A one-record payload of block k whose record says n (and has a digest, so that one is
    rendered)."""
    return SKELETONS.pack(k or key(n), b'"n":%d,"digest":"%s"}' % (n, key(n).encode()))


def array(k: str, n: int) -> bytes:
    """The JSON array ``packed(n, k)`` renders to."""
    return b'[{"block_key":"%s%s"n":%d,"digest":"%s"}]' % (k.encode(), IDENTITY, n, key(n).encode())


def frame(table: Any, keys: list[str]) -> tuple[int, bytes]:
    return table.join_prefix(keys, b"<", b"|", b",", b">")


operations = st.lists(
    st.tuples(st.sampled_from(["put", "put_none", "pop", "get"]), st.integers(0, 40)),
    max_size=400,
)


@both
@settings(max_examples=200)
@given(operations, st.lists(st.integers(0, 40), max_size=12))
def test_the_table_behaves_as_a_dict(
    impl: str, ops: list[tuple[str, int]], probe: list[int]
) -> None:
    table: Any = table_of(impl)
    model: dict[str, tuple[Value, bytes | None]] = {}
    for op, n in ops:
        k = key(n)
        if op in ("put", "put_none"):
            value = Value(n)
            table.put(k, value, packed(n) if op == "put" else None)
            model[k] = (value, array(k, n) if op == "put" else None)
        elif op == "pop":
            expected = model.pop(k, None)
            assert table.pop(k) is (None if expected is None else expected[0])
        else:
            assert table.get(k) is model.get(k, (None,))[0]
        assert len(table) == len(model)
    assert {id(v) for v in table.values()} == {id(v) for v, _ in model.values()}
    assert bool(table) == bool(model)
    keys = [key(n) for n in probe]
    leading = []
    for k in keys:
        if k not in model:
            break
        leading.append(model[k])
    assert table.prefix(keys) == [v for v, _ in leading]
    if any(payload is None for _, payload in leading):
        with pytest.raises(LookupError):
            frame(table, keys)
    else:
        joined = b",".join(payload for _, payload in leading if payload is not None)
        assert frame(table, keys) == (len(leading), b"<%d|%s>" % (len(leading), joined))


@both
def test_growth_and_removal_at_scale_keep_every_key(impl: str) -> None:
    table: Any = table_of(impl)
    keys = [key(n) for n in range(50_000)]
    for n, k in enumerate(keys):
        table.put(k, n, None)
    assert len(table) == 50_000
    for k in keys[::2]:
        assert table.pop(k) is not None
    assert len(table) == 25_000
    assert all(table.get(k) == n for n, k in enumerate(keys) if n % 2)
    assert all(table.get(k) is None for k in keys[::2])
    assert table.prefix(keys[1::2][:100]) == list(range(1, 200, 2))


@both
def test_prefixes_longer_than_a_probe_batch(impl: str) -> None:
    table: Any = table_of(impl)
    keys = [key(n) for n in range(300)]
    for n, k in enumerate(keys[:200]):
        table.put(k, n, packed(n))
    assert table.prefix(keys) == list(range(200))
    matched, answer = table.join_prefix(keys, b"", b":", b",", b"")
    assert matched == 200
    assert answer == b"200:" + b",".join(array(k, n) for n, k in enumerate(keys[:200]))


@pytest.mark.parametrize(
    "bad",
    ["AB" * 32, "g" * 64, "0" * 63, "0" * 65, "é" * 64, "0" * 63 + "\n", "", "\u0660" * 64],
)
@both
def test_malformed_keys_are_refused_everywhere(impl: str, bad: str) -> None:
    table: Any = table_of(impl)
    table.put(key(0), 0, packed(0))
    for call in (
        lambda: table.get(bad),
        lambda: table.put(bad, 1, None),
        lambda: table.pop(bad),
        lambda: table.prefix([bad]),
        lambda: IMPLEMENTATIONS[impl][1]([key(0), bad]),
    ):
        with pytest.raises(ValueError, match="hex digits"):
            call()
    assert len(table) == 1
    with pytest.raises(TypeError):
        table.get(b"00" * 32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block key 1"):
        IMPLEMENTATIONS[impl][1]([key(0), 7])  # type: ignore[list-item]
    IMPLEMENTATIONS[impl][1]([key(1), key(2)])


@both
def test_put_refuses_none_values_and_non_bytes_payloads(impl: str) -> None:
    table: Any = table_of(impl)
    with pytest.raises(ValueError, match="None"):
        table.put(key(0), None, None)
    with pytest.raises(TypeError, match="payload"):
        table.put(key(0), 1, "text")  # type: ignore[arg-type]
    assert len(table) == 0


@both
def test_the_table_releases_its_values_and_takes_part_in_garbage_collection(impl: str) -> None:
    table: Any = table_of(impl)
    value = Value(1)
    ref = weakref.ref(value)
    table.put(key(0), value, None)
    del value
    assert ref() is not None
    table.pop(key(0))
    assert ref() is None

    class Holder:
        pass

    cyclic = Holder()
    inner: Any = table_of(impl)
    inner.put(key(1), cyclic, None)
    cyclic.table = inner  # type: ignore[attr-defined]
    cycle_ref = weakref.ref(cyclic)
    del cyclic, inner
    gc.collect()
    assert cycle_ref() is None


@both
def test_a_value_let_go_by_put_may_use_the_table_as_it_goes(impl: str) -> None:
    """Replacing a value frees the old one, whose finaliser may change the table (here it
    grows it past a resize): the replaced slot is whole before that, and stays right."""
    table: Any = table_of(impl)

    class Grows:
        def __del__(self) -> None:
            for n in range(100, 140):
                table.put(key(n), Value(n), packed(n))

    for n in range(3):
        table.put(key(n), Value(n), None)
    table.put(key(0), Grows(), packed(1, key(0)))
    table.put(key(0), Value(7), packed(7, key(0)))
    assert table.get(key(0)).n == 7
    assert frame(table, [key(0)]) == (1, b"<1|%s>" % array(key(0), 7))
    assert len(table) == 43
    assert all(table.get(key(n)).n == n for n in range(100, 140))


@both
def test_a_block_of_records_renders_as_its_array_and_a_bad_payload_is_refused(impl: str) -> None:
    """Several records packed one after another render as one array; a payload that is cut
    short, names no skeleton or holds nothing is refused (never read past)."""
    table = table_of(impl)
    two = SKELETONS.pack(
        key(0), b'"h":1,"layer_digests":["%s","%s"]}' % (key(1).encode(), key(2).encode())
    )
    table.put(key(0), 0, packed(5, key(0)) + two)
    matched, answer = table.join_prefix([key(0)], b"", b"", b",", b"")
    record = b'{"block_key":"%s%s' % (key(0).encode(), IDENTITY)
    digests = b'"h":1,"layer_digests":["%s","%s"]}' % (key(1).encode(), key(2).encode())
    assert (matched, answer) == (1, b"1" + array(key(0), 5)[:-1] + b"," + record + digests + b"]")
    unknown = (len(SKELETONS.listed) + 10).to_bytes(4, "little") + bytes.fromhex(key(1))
    one = packed(1, key(1))
    for bad in (one + two[:-1], one[:-1], one + two[:3], unknown):
        table.put(key(1), 1, bad)
        with pytest.raises(ValueError, match=r"packed record|no record"):
            table.join_prefix([key(1)], b"", b"", b",", b"")
    # the table reads a block's key from its payload's first record: one of another key, or
    # too short to hold one, is refused and the entry held stays
    for bad in (two, two[:35], b""):
        with pytest.raises(ValueError, match="first record must be of its key"):
            table.put(key(1), 2, bad)
    assert table.get(key(1)) == 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0123456789abcdef" * 2, True),
        ("", True),
        ("0123456789abcdeF" * 2, False),
        ("0123456789abcdeg", False),
        ("01234567 9abcdef", False),
        ("0123456", False),  # not a multiple of 8
        ("é" * 8, False),
        ("\u0660" * 8, False),
        ("/:`@" * 2, False),  # the neighbours of the digit and letter ranges
    ],
)
@both
def test_is_hex(impl: str, text: str, expected: bool) -> None:
    assert IMPLEMENTATIONS[impl][2](text) is expected


@both
@given(st.binary(min_size=32, max_size=32))
def test_hex_decoding_agrees_with_bytes_fromhex(impl: str, octets: bytes) -> None:
    table: Any = table_of(impl)
    table.put(octets.hex(), 1, None)
    assert table.prefix(octets) == [1]  # packed form: the same key
    assert IMPLEMENTATIONS[impl][1]([octets.hex()]) is None


@both
@given(st.binary(min_size=32, max_size=32), st.integers(0, 63), st.integers(0, 255))
def test_a_key_with_any_one_character_changed_is_taken_only_if_still_hex(
    impl: str, octets: bytes, at: int, character: int
) -> None:
    text = octets.hex()
    changed = text[:at] + chr(character) + text[at + 1 :]
    table: Any = table_of(impl)
    if chr(character) in "0123456789abcdef":
        table.put(changed, 1, None)
        assert table.prefix(bytes.fromhex(changed)) == [1]
    else:
        with pytest.raises(ValueError, match="hex digits"):
            table.put(changed, 1, None)
        assert keytable.pack_keys(b'["%s"]' % changed.encode("latin-1")) is None


@both
@given(st.binary(min_size=32, max_size=32), st.binary(min_size=32, max_size=32))
def test_any_key_and_digest_octets_render_as_their_hex(
    impl: str, block: bytes, digest: bytes
) -> None:
    table: Any = table_of(impl)
    k = block.hex()
    table.put(k, 0, SKELETONS.pack(k, b'"digest":"%s"}' % digest.hex().encode()))
    rendered = b'[{"block_key":"%s%s"digest":"%s"}]' % (k.encode(), IDENTITY, digest.hex().encode())
    assert frame(table, [k]) == (1, b"<1|%s>" % rendered)


@both
def test_packed_keys_come_in_whole_keys(impl: str) -> None:
    table: Any = table_of(impl)
    with pytest.raises(ValueError, match="32 octets"):
        table.prefix(b"\0" * 31)
    assert table.prefix(b"") == []


def test_untrack_takes_objects_out_of_the_collector_and_they_are_still_freed() -> None:
    value, container = Value(1), [1, "two"]
    values = weakref.WeakSet([value])
    untrack(value, container, 3, "four")  # objects the collector never tracked are let be
    assert gc.is_tracked(value) is not COMPILED
    assert gc.is_tracked(container) is not COMPILED
    del value
    assert len(values) == 0  # freed at its last reference, untracked or not
    fresh = [1, "two"]
    keytable._untrack(fresh)  # the fallback's: pure Python cannot
    assert gc.is_tracked(fresh)


def test_without_the_compiled_modules_kvsp_still_indexes_and_verifies() -> None:
    """As on a machine with no C compiler: both compiled modules missing, the fallbacks serve."""
    probe = """
import sys
sys.modules["kvsp.index._keytable"] = None  # an import of it now fails
sys.modules["kvsp.core._sha256"] = None
import hashlib
from kvsp.core import sha256
from kvsp.core.clock import ManualClock
from kvsp.index import keytable
from kvsp.index.queries import decode_lookup
from kvsp.index.replicas import ReplicaTable
from kvsp.index.rules import IndexLimits
from tests.index.factories import COMPAT, SCOPE_A, key, replica
assert not keytable.COMPILED and not sha256.ACCELERATED
table = ReplicaTable(ManualClock(), IndexLimits())
table.publish_many([replica(0), replica(1)])
body = ('{"scope_id": "%s", "compat_id": "%s", "block_keys": ["%s", "%s", "%s"]}'
        % (SCOPE_A, COMPAT, key(0), key(1), key(2))).encode()
query = decode_lookup(body)
assert len(table.lookup(COMPAT, SCOPE_A, query.block_keys)) == 2
matched, answer = table.answer(COMPAT, SCOPE_A, query.block_keys)
assert matched == 2 and key(1).encode() in answer
assert sha256.sha256_ranges(b"abc", [(0, 3)]) == [hashlib.sha256(b"abc").digest()]
from kvsp.index import puts
if puts.split_puts is not puts._split_nothing:  # the splitter built, the table not
    records = [replica(2), replica(3), replica(1)]
    rendered = b",".join(r.model_dump_json(exclude_none=True).encode() for r in records)
    split = puts.RecordShapes().split(b'{"put":[%s]}' % rendered)
    assert split is not None
    assert [o.created for o in table.publish_shared(split)] == [True, True, False]
    assert table.answer(COMPAT, SCOPE_A, [key(0), key(1), key(2), key(3)])[0] == 4
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=False
    )
    assert done.stdout.strip() == "ok", done.stderr[-2000:]


#: each implementation of a stored replica, with the table that takes it as a payload
REPLICAS: dict[str, tuple[Any, Any]] = {"fallback": (keytable.SlotsReplica, DictKeyTable)}
if COMPILED:
    REPLICAS["compiled"] = (keytable.StoredReplica, KeyTable)
replicas = pytest.mark.parametrize("impl", sorted(REPLICAS))
SPACE = ("compat", "scope")


class Record:
    """An unpacked record, as the simulator stores it: all a replica reads is its block key."""

    def __init__(self, block_key: str) -> None:
        self.block_key = block_key


@replicas
def test_a_packed_replica_holds_its_fields_and_octets(impl: str) -> None:
    summary = object()
    octets = packed(3)
    replica = REPLICAS[impl][0](SPACE, "http://h", 1_000, octets, summary, SKELETONS)
    assert (replica.space, replica.holder, replica.expires_at) == (SPACE, "http://h", 1_000)
    assert replica.summary is summary
    assert replica.packed == octets
    assert replica.packed_by is SKELETONS
    assert replica.record is None
    assert replica.block_key == key(3)
    assert replica.replicas == (replica,)
    replica.summary = None  # the only member a store may change
    assert replica.summary is None


@replicas
def test_an_unpacked_replica_answers_its_records_key_and_no_octets(impl: str) -> None:
    record = Record(key(4))
    replica = REPLICAS[impl][0](SPACE, "http://h", 5, record)
    assert replica.record is record
    assert replica.packed_by is None
    assert replica.summary is None
    assert replica.block_key == key(4)
    with pytest.raises(LookupError, match="not packed"):
        _ = replica.packed


@replicas
def test_a_replica_refuses_octets_without_skeletons_and_short_records(impl: str) -> None:
    made = REPLICAS[impl][0]
    with pytest.raises(TypeError, match="skeletons"):
        made(SPACE, "http://h", 1, packed(1))
    with pytest.raises(TypeError, match="skeletons"):
        made(SPACE, "http://h", 1, Record(key(1)), None, SKELETONS)
    with pytest.raises(ValueError, match="skeleton number and a key"):
        made(SPACE, "http://h", 1, packed(1)[:35], None, SKELETONS)


@replicas
def test_replicas_are_ordered_by_deadline(impl: str) -> None:
    made = REPLICAS[impl][0]
    early, late = (made(SPACE, "h", t, Record(key(t))) for t in (1, 2))
    assert early < late
    assert not late < early
    assert sorted([late, early]) == [early, late]


@replicas
def test_a_packed_replica_is_a_payload_as_its_octets_are(impl: str) -> None:
    made, table_type = REPLICAS[impl]
    by_octets, by_replica = (table_type(IDENTITY, SKELETONS.listed) for _ in range(2))
    replica = made(SPACE, "http://h", 1, packed(8, key(0)), None, SKELETONS)
    by_octets.put(key(0), 0, packed(8, key(0)))
    by_replica.put(key(0), 0, replica)
    assert frame(by_replica, [key(0)]) == frame(by_octets, [key(0)])
    assert frame(by_replica, [key(0)]) == (1, b"<1|%s>" % array(key(0), 8))
    with pytest.raises(TypeError, match="payload"):
        by_replica.put(key(1), 1, made(SPACE, "http://h", 1, Record(key(1))))
    assert len(by_replica) == 1


@pytest.mark.skipif(not COMPILED, reason="built without a C compiler")
def test_a_compiled_plain_replica_takes_128_octets_and_no_collector_time() -> None:
    """Decision 0026: a record with its digest and no layer digests (68 packed octets) in
    one object."""
    replica = keytable.StoredReplica(SPACE, "h", 1, packed(1), None, SKELETONS)
    assert sys.getsizeof(replica) == 128
    assert not gc.is_tracked(replica)
    with pytest.raises(AttributeError):
        replica.expires_at = 2_000  # read-only: a deadline moves by a new replica


class Many:
    """A block of several replicas, as ``replicas.BlockReplicas`` holds them."""

    def __init__(self, replicas: tuple[Any, ...]) -> None:
        self.replicas = replicas


@replicas
@settings(max_examples=150)
@given(
    st.lists(st.sets(st.sampled_from(["http://a", "http://b", "http://c"]), min_size=1)),
    st.integers(0, 3),
)
def test_holder_runs_are_counted_as_the_prefix_walk_counts_them(
    impl: str, held: list[set[str]], missing: int
) -> None:
    made, table_type = REPLICAS[impl]
    table = table_type(IDENTITY, SKELETONS.listed)
    for n, holders in enumerate(held):
        stored = tuple(made(SPACE, h, 1, packed(n, key(n)), None, SKELETONS) for h in holders)
        table.put(key(n), stored[0] if len(stored) == 1 else Many(stored), None)
    asked = [key(n) for n in range(len(held) + missing)]
    blocks = table.prefix(asked)
    assert table.holder_runs(asked) == (len(blocks), keytable.holder_runs(blocks))
    assert table.holder_runs(b"".join(bytes.fromhex(k) for k in asked)) == table.holder_runs(asked)


@replicas
def test_holder_runs_refuse_blocks_of_anything_but_replicas(impl: str) -> None:
    table = REPLICAS[impl][1](IDENTITY, SKELETONS.listed)
    table.put(key(0), Many((Value(0),)), None)
    with pytest.raises((TypeError, AttributeError)):
        table.holder_runs([key(0)])
    table.put(key(0), Value(0), None)
    with pytest.raises(AttributeError):
        table.holder_runs([key(0)])
    table.put(key(0), Many([Value(0)]), None)  # a list, not a tuple
    with pytest.raises((TypeError, AttributeError)):
        table.holder_runs([key(0)])


@replicas
def test_a_run_is_stored_into_new_blocks_until_one_is_held(impl: str) -> None:
    """``put_run``: replicas packed from the run's head and each identity's key and digest,
    held as their blocks and pushed on the heap, up to the first block held already."""
    replica_type, table_type = REPLICAS[impl]
    table, deadlines, summary = table_type(IDENTITY, SKELETONS.listed), [], object()
    digest = hashlib.sha256(b"digest").digest()
    identities = b"".join(b"\0" * 48 + bytes.fromhex(key(n)) + digest for n in range(5))
    head = packed(0)[:4]
    table.put(key(3), Value(3), None)
    stopped = table.put_run(identities, 1, 5, head, SPACE, "h", 9, summary, SKELETONS, deadlines)
    assert stopped == 3
    assert table.put_run(identities, 4, 5, head, SPACE, "h", 9, summary, SKELETONS, deadlines) == 5
    assert table.get(key(0)) is None
    for n in (1, 2, 4):
        stored = table.get(key(n))
        assert isinstance(stored, replica_type)
        assert stored.packed == head + bytes.fromhex(key(n)) + digest
        assert (stored.space, stored.holder, stored.expires_at) == (SPACE, "h", 9)
        assert stored.summary is summary
        assert stored.packed_by is SKELETONS
    assert sorted(r.block_key for r in deadlines) == sorted([key(1), key(2), key(4)])
    assert table.put_run(identities, 5, 5, head, SPACE, "h", 9, summary, SKELETONS, deadlines) == 5
