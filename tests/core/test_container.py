"""KVB1 container: round trips, incremental parsing, slicing, and hostile input."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.core.compat import Geometry
from kvsp.core.container import (
    Container,
    ContainerParser,
    section_array,
    section_octets,
)
from kvsp.core.problems import (
    ContainerError,
    ContainerHeaderError,
    ContainerLengthError,
    ContainerTrailingDataError,
    ContainerTruncatedError,
    DigestError,
    LayerRangeError,
)
from kvsp.core.registries import ELEMENT_TYPES

DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8}


@st.composite
def blocks(draw: st.DrawFn) -> tuple[Geometry, int, int, list[tuple[np.ndarray, np.ndarray]]]:
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    layers = draw(st.integers(1, 5))
    first = draw(st.integers(0, 3))
    geometry = Geometry(
        layers=first + layers + draw(st.integers(0, 2)),
        kv_heads=draw(st.integers(1, 3)),
        head_dim=draw(st.integers(1, 8)),
        element=ELEMENT_TYPES[dtype],
    )
    tokens = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    shape = (tokens, geometry.kv_heads, geometry.head_dim)
    arrays = [
        (
            (rng.standard_normal(shape) * 50).astype(DTYPES[dtype]),
            (rng.standard_normal(shape) * 50).astype(DTYPES[dtype]),
        )
        for _ in range(layers)
    ]
    return geometry, first, tokens, arrays


def _parse_incrementally(data: bytes) -> Container:
    parser = ContainerParser()
    parser.feed(data)
    return parser.finish()


def _accept_or_container_error(blob: bytes) -> None:
    """Both parse paths either reject ``blob`` with a ContainerError or accept it whole."""
    for parse in (Container.parse, _parse_incrementally):
        try:
            container = parse(blob)
        except ContainerError:
            continue
        assert container.tobytes() == blob
        assert container.size == len(blob)


def _valid_container(seed: int = 1, layers: int = 3, tokens: int = 2) -> bytes:
    rng = np.random.default_rng(seed)
    arrays = [(rng.standard_normal((tokens, 2, 4)).astype(np.float32),) * 2 for _ in range(layers)]
    return Container.build(0, tokens, arrays).tobytes()


@given(blocks())
def test_round_trip_random_geometry(block: tuple) -> None:  # type: ignore[type-arg]
    geometry, first, tokens, arrays = block
    built = Container.build(first, tokens, arrays, geometry=geometry)
    parsed = Container.parse(built.tobytes(), geometry)
    assert parsed.header == built.header
    assert parsed.header.first_layer == first
    for layer, (k, v) in zip(parsed.layers, arrays, strict=True):
        got_k = section_array(layer.k, geometry.element, geometry.kv_heads, geometry.head_dim)
        got_v = section_array(layer.v, geometry.element, geometry.kv_heads, geometry.head_dim)
        assert got_k.tobytes() == k.astype(k.dtype.newbyteorder("<")).tobytes()
        np.testing.assert_array_equal(got_k.astype(k.dtype), k)
        np.testing.assert_array_equal(got_v.astype(v.dtype), v)
    assert parsed.layer_digests() == built.layer_digests()
    assert parsed.digest() == built.digest()
    octets = built.tobytes()
    assert bytes(parsed.data()) == bytes(built.data()) == octets[built.header.header_octets :]
    sha256 = hashlib.sha256(octets).digest()
    assert built.sha256() == sha256
    fresh = Container.parse(octets, geometry)  # its layer digests come with the whole one
    assert fresh.sha256() == sha256
    assert fresh.layer_digests() == built.layer_digests()
    for container in (built, parsed):  # each layer says where it lies in the representation
        for layer in container.layers:
            at = layer.offset
            assert octets[at : at + len(layer.k)] == bytes(layer.k)
            assert octets[at + len(layer.k) : at + len(layer.k) + len(layer.v)] == bytes(layer.v)


@given(blocks(), st.lists(st.integers(1, 400), min_size=1, max_size=60))
def test_incremental_parse_equals_whole_parse(block: tuple, cuts: list[int]) -> None:  # type: ignore[type-arg]
    geometry, first, tokens, arrays = block
    data = Container.build(first, tokens, arrays, geometry=geometry).tobytes()
    whole = Container.parse(data, geometry)
    parser = ContainerParser(
        geometry, expected_digests=[b""] * first + list(whole.layer_digests()), whole_digest=True
    )
    seen = []
    pos = 0
    for cut in cuts:
        seen.extend(parser.feed(data[pos : pos + cut]))
        pos += cut
        # every layer whose octets are in has been yielded, and no other
        assert [s.layer for s in seen] == [
            layer.layer
            for layer in whole.layers
            if whole.header.offset_of(layer.layer) + len(layer.k) + len(layer.v) <= pos
        ]
        if pos >= len(data):
            break
        assert parser.sha256 is None  # computed by the step that completes the container
    seen.extend(parser.feed(data[pos:]))
    final = parser.finish()
    assert parser.sha256 == final.sha256() == hashlib.sha256(data).digest()
    assert [(s.layer, bytes(s.k), bytes(s.v), s.offset) for s in seen] == [
        (s.layer, bytes(s.k), bytes(s.v), s.offset) for s in whole.layers
    ]
    assert final.header == whole.header
    assert parser.digests == list(whole.layer_digests())
    assert final.tobytes() == data


def test_layer_arrives_before_the_container_ends() -> None:
    data = _valid_container(layers=3, tokens=2)
    parser = ContainerParser()
    header_octets = 20 + 3 * 16
    layer_octets = 2 * 2 * 2 * 4 * 4
    assert parser.feed(data[: header_octets + layer_octets - 1]) == []
    first = parser.feed(data[header_octets + layer_octets - 1 : header_octets + layer_octets])
    assert [layer.layer for layer in first] == [0]
    assert not parser.complete
    rest = parser.feed(data[header_octets + layer_octets :])
    assert [layer.layer for layer in rest] == [1, 2]
    assert parser.complete


def test_one_byte_at_a_time() -> None:
    data = _valid_container(layers=2)
    parser = ContainerParser()
    layers = [layer for i in range(len(data)) for layer in parser.feed(data[i : i + 1])]
    assert [layer.layer for layer in layers] == [0, 1]
    assert parser.finish().tobytes() == data


@given(st.data())
def test_corruption_raises_only_container_error(data: st.DataObject) -> None:
    original = bytearray(_valid_container(seed=data.draw(st.integers(0, 100))))
    flips = data.draw(st.lists(st.integers(0, len(original) - 1), min_size=1, max_size=4))
    for pos in flips:
        original[pos] ^= data.draw(st.integers(1, 255))
    corrupted = bytes(original)
    _accept_or_container_error(corrupted)


@given(st.data())
def test_truncation_raises_only_container_error(data: st.DataObject) -> None:
    original = _valid_container()
    cut = data.draw(st.integers(0, len(original) - 1))
    with pytest.raises(ContainerError):
        Container.parse(original[:cut])
    with pytest.raises(ContainerError):
        _parse_incrementally(original[:cut])


@given(st.binary(max_size=200))
def test_arbitrary_octets_raise_only_container_error(blob: bytes) -> None:
    _accept_or_container_error(blob)


def _header(
    magic: bytes = b"KVB1",
    version: int = 1,
    flags: int = 0,
    codec: int = 1,
    first: int = 0,
    count: int = 1,
    tokens: int = 1,
    lengths: tuple[int, ...] = (8, 8),
) -> bytes:
    fixed = struct.pack(">4sBBHIII", magic, version, flags, codec, first, count, tokens)
    return fixed + struct.pack(f">{len(lengths)}Q", *lengths)


@pytest.mark.parametrize(
    ("blob", "error", "match"),
    [
        (_header(magic=b"KVB2") + bytes(16), ContainerHeaderError, "magic"),
        (_header(version=2) + bytes(16), ContainerHeaderError, "version"),
        (_header(flags=1) + bytes(16), ContainerHeaderError, "flags"),
        (_header(codec=7) + bytes(16), ContainerHeaderError, "codec"),
        (_header(count=0, lengths=()), ContainerHeaderError, "layer count"),
        (_header(tokens=0) + bytes(16), ContainerHeaderError, "token count"),
        (_header(lengths=(8, 4)) + bytes(12), ContainerLengthError, "equal"),
        (_header(lengths=(0, 0)), ContainerLengthError, "empty"),
        (_header(tokens=3) + bytes(16), ContainerLengthError, "whole number"),
        (_header() + bytes(15), ContainerTruncatedError, "announces"),
        (_header() + bytes(17), ContainerTrailingDataError, "after the last"),
        (_header(count=2), ContainerTruncatedError, "shorter than the header"),
        (
            _header(first=0xFFFFFFFF, count=2, lengths=(8, 8, 8, 8)) + bytes(32),
            ContainerHeaderError,
            "2\\^32",
        ),
        (_header(lengths=(2**63, 2**63)), ContainerLengthError, "limit"),
        (_header(count=2**31, lengths=()), ContainerLengthError, "limit"),
    ],
)
def test_malformed_headers(blob: bytes, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        Container.parse(blob)


def test_geometry_fixes_section_size() -> None:
    geometry = Geometry(layers=4, kv_heads=2, head_dim=4, element=ELEMENT_TYPES["float32"])
    good = np.zeros((3, 2, 4), np.float32)
    Container.build(0, 3, [(good, good)], geometry=geometry)
    bad = np.zeros((3, 2, 2), np.float32)
    with pytest.raises(ContainerLengthError, match="must be 96 octets"):
        Container.build(0, 3, [(bad, bad)], geometry=geometry)
    with pytest.raises(ContainerHeaderError, match="outside the model"):
        Container.build(3, 3, [(good, good)] * 2, geometry=geometry)


def test_parser_limits_memory_before_allocating() -> None:
    parser = ContainerParser(max_octets=1024)
    with pytest.raises(ContainerLengthError, match="limit"):
        parser.feed(_header(lengths=(4096, 4096)))


def test_slice_is_zero_copy_and_valid() -> None:
    data = _valid_container(layers=5, tokens=2)
    container = Container.parse(data)
    part = container.slice(1, 3)
    assert len(part.parts) == 2
    assert part.parts[1].obj is data  # type: ignore[union-attr]  # a view, not a copy
    sliced = Container.parse(part.tobytes())
    assert sliced.header.first_layer == 1
    assert sliced.header.layer_count == 3
    assert sliced.layer_digests() == container.layer_digests()[1:4]
    assert part.sha256() == hashlib.sha256(part.tobytes()).digest()
    assert part.layer_digests() == container.layer_digests()[1:4]
    assert part.size == len(part.tobytes())
    sliced.verify(list(container.layer_digests()), container.digest())
    with pytest.raises(LayerRangeError):
        container.slice(3, 5)
    with pytest.raises(LayerRangeError):
        container.slice(2, 1)


def test_built_container_views_the_sections_and_slices_them() -> None:
    arrays = [
        (np.full((2, 1, 2), i, np.float32), np.full((2, 1, 2), -i, np.float32)) for i in range(4)
    ]
    built = Container.build(0, 2, arrays)
    assert built.parts[1].obj is arrays[0][0]  # type: ignore[union-attr]
    assert built.size == len(built.tobytes())
    part = built.slice(1, 2)
    assert part.tobytes() == Container.parse(built.tobytes()).slice(1, 2).tobytes()
    assert Container.parse(part.tobytes()).layer_digests() == built.layer_digests()[1:3]


def test_verify_detects_a_wrong_layer_and_a_wrong_replica_digest() -> None:
    container = Container.parse(_valid_container(layers=2))
    digests = list(container.layer_digests())
    container.verify(digests, container.digest())
    with pytest.raises(DigestError, match="replica"):
        container.verify(digests, bytes(32))
    with pytest.raises(DigestError, match="layer 1"):
        container.verify([digests[0], bytes(32)])
    parser = ContainerParser(expected_digests=[digests[0], bytes(32)])
    with pytest.raises(DigestError, match="layer 1"):
        parser.feed(container.tobytes())


def test_sections_accept_buffers_and_big_endian_arrays() -> None:
    little = np.arange(8, dtype="<f4").reshape(1, 2, 4)
    big = little.astype(">f4")
    assert bytes(section_octets(big)) == little.tobytes()
    assert section_octets(little).obj is not None
    with pytest.raises(ContainerLengthError, match="tokens, kv_heads, head_dim"):
        section_octets(np.zeros((2, 2), np.float32))
    with pytest.raises(ContainerLengthError, match="contiguous"):
        section_octets(memoryview(np.zeros((4, 4, 4), np.float32)[:, ::2]))


def test_bfloat16_sections_keep_octets() -> None:
    raw = np.arange(12, dtype="<u2").reshape(2, 2, 3)
    geometry = Geometry(layers=1, kv_heads=2, head_dim=3, element=ELEMENT_TYPES["bfloat16"])
    built = Container.build(0, 2, [(raw.tobytes(), raw.tobytes())], geometry=geometry)
    view = section_array(built.layers[0].k, geometry.element, 2, 3)
    np.testing.assert_array_equal(view, raw)


def test_parser_keeps_rejecting_after_an_error() -> None:
    parser = ContainerParser()
    assert parser.feed(b"KVB1\x02") == []  # version 2 shows once the fixed header is in
    with pytest.raises(ContainerHeaderError):
        parser.feed(bytes(20))
    with pytest.raises(ContainerError):
        parser.feed(bytes(40))
