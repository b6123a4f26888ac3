"""``sha256_ranges`` and ``RangeHasher``: the digests of any ranges of a buffer are hashlib's,
on two lanes (where this CPU has the SHA extensions) and without them, whether the buffer is
hashed at once or as it fills, in steps of any size."""

from __future__ import annotations

import hashlib
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsp.core import sha256
from kvsp.core.sha256 import RangeHasher, _sha256, sha256_ranges  # _sha256: None if not built

Ranges = list[tuple[int, int]]

#: lengths around the padding's edges (55/56 octets of tail: one padding block or two)
EDGES = [0, 1, 55, 56, 57, 63, 64, 65, 119, 120, 127, 128, 129, 1000]


@pytest.fixture(params=["lanes", "hashlib"])
def way(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "lanes":
        if not sha256.ACCELERATED:
            pytest.skip("no SHA extensions on this CPU, or _sha256 not built")
    else:
        monkeypatch.setattr(sha256, "ACCELERATED", False)
    return str(request.param)


@st.composite
def buffers_and_ranges(draw: st.DrawFn) -> tuple[bytes, Ranges]:
    data = draw(st.binary(max_size=3000))
    ranges = []
    for _ in range(draw(st.integers(0, 7))):
        start = draw(st.integers(0, len(data)))
        length = draw(st.sampled_from(EDGES) | st.integers(0, len(data)))
        ranges.append((start, min(len(data), start + length)))
    return data, ranges


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # one way throughout
@given(buffers_and_ranges())
def test_each_range_gets_hashlibs_digest(way: str, case: tuple[bytes, Ranges]) -> None:
    data, ranges = case
    want = [hashlib.sha256(data[a:b]).digest() for a, b in ranges]
    assert sha256_ranges(data, ranges) == want
    assert sha256_ranges(bytearray(data), ranges) == want
    assert sha256_ranges(memoryview(data), ranges) == want


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(buffers_and_ranges(), st.lists(st.integers(0, 3000), max_size=8))
def test_hashed_as_it_fills_each_range_completes_once_with_hashlibs_digest(
    way: str, case: tuple[bytes, Ranges], steps: list[int]
) -> None:
    """A range completes once, never before its end is in, and at the latest once its own
    octets and those of every range before it are in (lanes take ranges in order)."""
    data, ranges = case
    hasher = RangeHasher(len(data), ranges)
    completed: list[int] = []
    for filled in [*sorted(min(s, len(data)) for s in steps), len(data)]:
        now = hasher.advance(bytearray(data), filled)
        assert not set(now) & set(completed)
        completed += now
        assert all(ranges[i][1] <= filled for i in completed)
        ends = [stop for _, stop in ranges]
        due = [i for i in range(len(ranges)) if max(ends[: i + 1]) <= filled]
        assert set(due) <= set(completed)
    for i, (a, b) in enumerate(ranges):
        assert hasher.digest(i) == hashlib.sha256(data[a:b]).digest()


def test_a_range_not_complete_has_no_digest_yet(way: str) -> None:
    hasher = RangeHasher(200, [(0, 200), (0, 70)])
    assert hasher.advance(bytes(200), 100) == [1]
    with pytest.raises(ValueError, match="range 0 is not complete"):
        hasher.digest(0)


@pytest.mark.parametrize(
    ("buffer", "filled"), [(bytes(99), 10), (bytes(100), 101), (bytes(100), -1)]
)
def test_a_buffer_or_fill_that_does_not_fit_the_ranges_is_refused(
    way: str, buffer: bytes, filled: int
) -> None:
    with pytest.raises(ValueError, match="octets"):
        RangeHasher(100, [(0, 100)]).advance(buffer, filled)


def test_a_container_and_its_layers(way: str) -> None:
    """The shape a received block has: the whole first, then 30 layers of uneven sizes."""
    data = os.urandom(737_280 + 517)
    layers = [(517 + 24_576 * i, 517 + 24_576 * (i + 1)) for i in range(30)]
    ranges = [(0, len(data)), *layers, (3, 3), (len(data), len(data))]
    assert sha256_ranges(data, ranges) == [hashlib.sha256(data[a:b]).digest() for a, b in ranges]


@pytest.mark.parametrize("bad", [(-1, 2), (3, 2), (0, 11), (11, 11)])
def test_a_range_outside_the_buffer_is_refused(way: str, bad: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="not within 10 octets"):
        sha256_ranges(bytes(10), [(0, 10), bad])
    with pytest.raises(ValueError, match="not within 10 octets"):
        RangeHasher(10, [(0, 10), bad])


@pytest.mark.skipif(not sha256.ACCELERATED, reason="no SHA extensions, or _sha256 not built")
@pytest.mark.parametrize("ranges", [[(0, 1, 2)], [[0, 1]], [("0", 1)], 5])
def test_ranges_that_are_not_pairs_of_ints_are_a_type_error(ranges: object) -> None:
    with pytest.raises(TypeError):
        _sha256.Hasher(10, ranges)  # type: ignore[arg-type,union-attr]
