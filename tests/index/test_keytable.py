"""The compiled block-key table against a dict model: every operation, malformed keys, growth,
deletion inside probe runs, and the answer it assembles."""

from __future__ import annotations

import gc
import hashlib
import weakref

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp.index._keytable import KeyTable, check_keys, is_hex


def key(n: int) -> str:
    return hashlib.sha256(b"%d" % n).hexdigest()


class Value:
    """A value whose identity the table must keep."""

    def __init__(self, n: int) -> None:
        self.n = n


def frame(table: KeyTable[Value], keys: list[str]) -> tuple[int, bytes]:
    return table.join_prefix(keys, b"<", b"|", b",", b">")


operations = st.lists(
    st.tuples(st.sampled_from(["put", "put_none", "pop", "get"]), st.integers(0, 40)),
    max_size=400,
)


@settings(max_examples=200)
@given(operations, st.lists(st.integers(0, 40), max_size=12))
def test_the_table_behaves_as_a_dict(ops: list[tuple[str, int]], probe: list[int]) -> None:
    table: KeyTable[Value] = KeyTable()
    model: dict[str, tuple[Value, bytes | None]] = {}
    for op, n in ops:
        k = key(n)
        if op in ("put", "put_none"):
            value = Value(n)
            payload = b"[%d]" % n if op == "put" else None
            table.put(k, value, payload)
            model[k] = (value, payload)
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


def test_growth_and_removal_at_scale_keep_every_key() -> None:
    table: KeyTable[int] = KeyTable()
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


def test_prefixes_longer_than_a_probe_batch() -> None:
    table: KeyTable[int] = KeyTable()
    keys = [key(n) for n in range(300)]
    for n, k in enumerate(keys[:200]):
        table.put(k, n, b"%d" % n)
    assert table.prefix(keys) == list(range(200))
    matched, answer = table.join_prefix(keys, b"", b":", b",", b"")
    assert matched == 200
    assert answer == b"200:" + b",".join(b"%d" % n for n in range(200))


@pytest.mark.parametrize(
    "bad",
    ["AB" * 32, "g" * 64, "0" * 63, "0" * 65, "é" * 64, "0" * 63 + "\n", "", "\u0660" * 64],
)
def test_malformed_keys_are_refused_everywhere(bad: str) -> None:
    table: KeyTable[int] = KeyTable()
    table.put(key(0), 0, b"0")
    for call in (
        lambda: table.get(bad),
        lambda: table.put(bad, 1, None),
        lambda: table.pop(bad),
        lambda: table.prefix([bad]),
        lambda: check_keys([key(0), bad]),
    ):
        with pytest.raises(ValueError, match="hex digits"):
            call()
    assert len(table) == 1
    with pytest.raises(TypeError):
        table.get(b"00" * 32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block key 1"):
        check_keys([key(0), 7])  # type: ignore[list-item]
    check_keys([key(1), key(2)])


def test_put_refuses_none_values_and_non_bytes_payloads() -> None:
    table: KeyTable[object] = KeyTable()
    with pytest.raises(ValueError, match="None"):
        table.put(key(0), None, None)
    with pytest.raises(TypeError, match="payload"):
        table.put(key(0), 1, "text")  # type: ignore[arg-type]
    assert len(table) == 0


def test_the_table_releases_its_values_and_takes_part_in_garbage_collection() -> None:
    table: KeyTable[object] = KeyTable()
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
    inner: KeyTable[object] = KeyTable()
    inner.put(key(1), cyclic, None)
    cyclic.table = inner  # type: ignore[attr-defined]
    cycle_ref = weakref.ref(cyclic)
    del cyclic, inner
    gc.collect()
    assert cycle_ref() is None


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
def test_is_hex(text: str, expected: bool) -> None:
    assert is_hex(text) is expected


@given(st.binary(min_size=32, max_size=32))
def test_hex_decoding_agrees_with_bytes_fromhex(octets: bytes) -> None:
    table: KeyTable[int] = KeyTable()
    table.put(octets.hex(), 1, None)
    assert table.prefix(octets) == [1]  # packed form: the same key
    assert check_keys([octets.hex()]) is None


def test_packed_keys_come_in_whole_keys() -> None:
    table: KeyTable[int] = KeyTable()
    with pytest.raises(ValueError, match="32 octets"):
        table.prefix(b"\0" * 31)
    assert table.prefix(b"") == []
