"""The KV Block Container, KVB1 (KVSP 4.3): encode, validate, parse incrementally, slice.

Design points:

- Data is copied at most once. ``Container.build`` writes every section straight into one
  pre-sized buffer (hashing the source while it is hot); ``Container.parse`` and the incremental
  ``ContainerParser`` hand out memoryviews into the received octets; ``Container.slice`` returns
  a new header plus one view of the contiguous layer range, so serving ``?layers=a-b`` copies
  nothing.
- Layers are in ascending order, so ``ContainerParser`` yields each layer as soon as its octets
  have arrived and a receiver can start using layer ``l`` while later layers are in flight.
- Untrusted input can only ever raise a ``ContainerError`` subclass (or ``DigestError`` when
  expected digests are given). Sizes announced by a header are checked against a limit before
  any buffer is allocated, so a hostile header cannot pin memory.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

from kvsp.core.compat import Geometry
from kvsp.core.problems import (
    ContainerError,
    ContainerHeaderError,
    ContainerLengthError,
    ContainerTrailingDataError,
    ContainerTruncatedError,
    DigestError,
    LayerRangeError,
)
from kvsp.core.registries import CODEC_RAW, CODECS, SERVED_CODECS, ElementType
from kvsp.core.sha256 import RangeHasher, sha256_ranges

__all__ = [
    "DEFAULT_MAX_CONTAINER_OCTETS",
    "FIXED_HEADER_OCTETS",
    "MAGIC",
    "VERSION",
    "Container",
    "ContainerHeader",
    "ContainerParser",
    "LayerSections",
    "Section",
    "layer_digest",
    "peek_header",
    "replica_digest",
    "section_array",
    "section_octets",
]

MAGIC = b"KVB1"
VERSION = 1
_FIXED = struct.Struct(">4sBBHIII")
FIXED_HEADER_OCTETS = _FIXED.size
_ENTRY_OCTETS = 16
_U32_MAX = 0xFFFFFFFF
#: numpy byte-order marks that already mean little-endian octets on this machine.
_LITTLE_ORDERS = "<|=" if sys.byteorder == "little" else "<|"
#: Largest container a parser accepts unless told otherwise (a 2 MiB block is typical).
DEFAULT_MAX_CONTAINER_OCTETS = 1 << 30

Section: TypeAlias = bytes | bytearray | memoryview | npt.NDArray[np.generic]


def layer_digest(k: bytes | memoryview, v: bytes | memoryview) -> bytes:
    """SHA-256 of a layer's K section followed by its V section."""
    h = hashlib.sha256(k)
    h.update(v)
    return h.digest()


def replica_digest(layer_digests: Sequence[bytes]) -> bytes:
    """SHA-256 of the concatenated layer digests of all layers, ascending."""
    return hashlib.sha256(b"".join(layer_digests)).digest()


def section_octets(section: Section) -> memoryview:
    """A section as flat octets without copying: a buffer as is, or an array in kvsp-layout-1.

    Arrays must be shaped [tokens, kv_heads, head_dim]; they are viewed in little-endian,
    C order (token index slowest), which copies only if the array is not already so.
    """
    if isinstance(section, np.ndarray):
        view = section.data
        if view.ndim != 3:
            raise ContainerLengthError(
                f"a section array must be [tokens, kv_heads, head_dim], got shape {section.shape}"
            )
        if not view.c_contiguous or section.dtype.byteorder not in _LITTLE_ORDERS:
            view = np.ascontiguousarray(section, dtype=section.dtype.newbyteorder("<")).data
        return view.cast("B")
    view = memoryview(section)
    if not view.c_contiguous:
        raise ContainerLengthError("a section buffer must be contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def section_array(
    section: bytes | bytearray | memoryview, element: ElementType, kv_heads: int, head_dim: int
) -> npt.NDArray[np.generic]:
    """A zero-copy [tokens, kv_heads, head_dim] view of a kvsp-layout-1 section.

    The dtype is the element type's little-endian storage dtype (raw 16/8-bit integers for
    bfloat16 and float8, which numpy cannot interpret).
    """
    per_token = kv_heads * head_dim * element.size
    if len(section) % per_token:
        raise ContainerLengthError(
            f"section of {len(section)} octets is not a whole number of tokens of {per_token}"
        )
    flat = np.frombuffer(section, dtype=np.dtype(element.storage_dtype))
    return flat.reshape(-1, kv_heads, head_dim)


@dataclass(frozen=True, slots=True)
class ContainerHeader:
    """A validated KVB1 header (version 1, flags 0): codec, layers and section lengths."""

    codec: int
    first_layer: int
    token_count: int
    lengths: tuple[tuple[int, int], ...]
    #: the octets of all sections (summed once: a parser asks at every step)
    data_octets: int = field(init=False, repr=False, compare=False)
    #: the encoding, once asked for (a holder sends a stored block's header with every GET)
    _encoded: bytes | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_octets", sum(k + v for k, v in self.lengths))

    @property
    def layer_count(self) -> int:
        return len(self.lengths)

    @property
    def last_layer(self) -> int:
        return self.first_layer + len(self.lengths) - 1

    @property
    def header_octets(self) -> int:
        return FIXED_HEADER_OCTETS + _ENTRY_OCTETS * len(self.lengths)

    @property
    def total_octets(self) -> int:
        return self.header_octets + self.data_octets

    def encode(self) -> bytes:
        encoded = self._encoded
        if encoded is None:
            fixed = _FIXED.pack(
                MAGIC, VERSION, 0, self.codec, self.first_layer, len(self.lengths), self.token_count
            )
            flat = [n for pair in self.lengths for n in pair]
            encoded = fixed + struct.pack(f">{len(flat)}Q", *flat)
            object.__setattr__(self, "_encoded", encoded)
        return encoded

    def check(self, geometry: Geometry | None = None) -> None:
        """Consistency of counts and lengths; with a geometry, exact raw section sizes."""
        if self.codec not in SERVED_CODECS:
            known = "names no container" if self.codec in CODECS else "is not registered"
            raise ContainerHeaderError(f"codec {self.codec:#06x} {known}")
        if not self.lengths:
            raise ContainerHeaderError("layer count must be at least 1")
        if self.token_count < 1:
            raise ContainerHeaderError("token count must be at least 1")
        if self.first_layer + len(self.lengths) - 1 > _U32_MAX:
            raise ContainerHeaderError("layer range exceeds 2^32-1")
        if geometry is not None and self.last_layer >= geometry.layers:
            raise ContainerHeaderError(
                f"layers {self.first_layer}-{self.last_layer} outside the model's "
                f"{geometry.layers} layers"
            )
        if self.codec != CODEC_RAW:
            return
        expected = None if geometry is None else geometry.section_bytes(self.token_count)
        first = self.lengths[0][0]
        uniform = first if expected is None else expected
        if set(self.lengths) == {(uniform, uniform)} and uniform % self.token_count == 0:
            if uniform == 0:
                raise ContainerLengthError("raw sections must not be empty")
            return
        for i, (k, v) in enumerate(self.lengths):  # name the first offending layer
            layer = self.first_layer + i
            if expected is not None and (k != expected or v != expected):
                raise ContainerLengthError(
                    f"layer {layer}: raw sections must be {expected} octets "
                    f"(token_count x kv_heads x head_dim x element size), got K={k} V={v}"
                )
            if k != v or k != first:
                raise ContainerLengthError(
                    f"layer {layer}: raw K and V sections must all be equal, got K={k} V={v} "
                    f"(layer {self.first_layer} has {first})"
                )
            if k % self.token_count:
                raise ContainerLengthError(
                    f"layer {layer}: {k} octets is not a whole number of {self.token_count} tokens"
                )

    def sliced(self, first: int, last: int) -> ContainerHeader:
        if not (self.first_layer <= first <= last <= self.last_layer):
            raise LayerRangeError(
                f"layers {first}-{last} are not within {self.first_layer}-{self.last_layer}"
            )
        lo = first - self.first_layer
        return ContainerHeader(
            self.codec, first, self.token_count, self.lengths[lo : lo + last - first + 1]
        )

    def offset_of(self, layer: int) -> int:
        """Octet offset of ``layer``'s K section within the container."""
        pos = self.header_octets
        for k, v in self.lengths[: layer - self.first_layer]:
            pos += k + v
        return pos


def peek_header(prefix: bytes | memoryview, max_octets: int) -> ContainerHeader | None:
    """The header of a container whose first octets are ``prefix``; None while more octets
    are needed. Lets a receiver refuse a container before reading the rest of it."""
    return _read_header(memoryview(prefix), max_octets)


def _read_header(data: memoryview, max_octets: int) -> ContainerHeader | None:
    """Parse a header from the start of ``data``; None while more octets are needed."""
    if len(data) < FIXED_HEADER_OCTETS:
        if bytes(data[: len(MAGIC)]) != MAGIC[: min(len(data), len(MAGIC))]:
            raise ContainerHeaderError("bad magic: not a KVB1 container")
        return None
    magic, version, flags, codec, first_layer, layer_count, token_count = _FIXED.unpack_from(data)
    if magic != MAGIC:
        raise ContainerHeaderError("bad magic: not a KVB1 container")
    if version != VERSION:
        raise ContainerHeaderError(f"unsupported container version {version}")
    if flags != 0:
        raise ContainerHeaderError(f"reserved flags must be zero, got {flags:#04x}")
    header_octets = FIXED_HEADER_OCTETS + _ENTRY_OCTETS * layer_count
    if header_octets > max_octets:
        raise ContainerLengthError(
            f"{layer_count} layers need a {header_octets}-octet header, above the "
            f"{max_octets}-octet limit"
        )
    if len(data) < header_octets:
        return None
    flat = struct.unpack_from(f">{2 * layer_count}Q", data, FIXED_HEADER_OCTETS)
    lengths = tuple(zip(flat[0::2], flat[1::2], strict=True))
    header = ContainerHeader(codec, first_layer, token_count, lengths)
    if header.total_octets > max_octets:
        raise ContainerLengthError(
            f"container announces {header.total_octets} octets, above the {max_octets}-octet limit"
        )
    return header


@dataclass(frozen=True, slots=True)
class LayerSections:
    """One layer of a container: zero-copy views of its K and V sections, and where the K
    section starts in the container's representation (the V section follows it)."""

    layer: int
    k: memoryview
    v: memoryview
    offset: int

    @property
    def span(self) -> tuple[int, int]:
        """Where the layer's octets start and stop in the container's representation (K, then
        V: a layer digest covers exactly this range of a contiguous container)."""
        return self.offset, self.offset + len(self.k) + len(self.v)

    def digest(self) -> bytes:
        return layer_digest(self.k, self.v)


def _layers(
    header: ContainerHeader, data: memoryview, start: int, stop: int
) -> list[LayerSections]:
    """Views of the layers at positions ``start``..``stop-1``, from the contiguous data region
    ``data`` (which begins with the first layer's K section)."""
    out = []
    pos = header.offset_of(header.first_layer + start) - header.header_octets
    for i in range(start, stop):
        k, v = header.lengths[i]
        section = data[pos : pos + k], data[pos + k : pos + k + v]
        out.append(LayerSections(header.first_layer + i, *section, header.header_octets + pos))
        pos += k + v
    return out


def _check_layers(first: int, got: Sequence[bytes], expected: Sequence[bytes]) -> None:
    """The computed digests of consecutive layers from layer number ``first`` against the
    expected ones (indexed by layer number)."""
    for layer, digest in enumerate(got, start=first):
        if layer >= len(expected):
            raise DigestError(f"no expected digest for layer {layer}")
        if digest != expected[layer]:
            raise DigestError(f"layer {layer}: digest does not match the replica record")


class Container:
    """A validated KVB1 container: its header and zero-copy views of every layer.

    The representation is ``parts``: the encoded header followed by data buffers, to be written
    in order. A parsed container views the received octets (one data part); a built container
    views the caller's sections (two parts per layer) and copies nothing, so the one copy of
    the data happens where it must (a socket, a file, ``tobytes``). A built container stays
    valid only while the caller leaves its section memory unchanged.
    """

    __slots__ = ("_data", "_digests", "_header_octets", "_layers", "_sha256", "_whole", "header")

    def __init__(
        self,
        header: ContainerHeader,
        header_octets: bytes | memoryview,
        data: Sequence[memoryview],
        digests: Sequence[bytes] | None = None,
    ) -> None:
        """``data`` is either one contiguous data region or a K and a V view per layer."""
        self.header = header
        self._header_octets = header_octets
        self._data = tuple(data)
        self._digests = None if digests is None else tuple(digests)
        self._layers: tuple[LayerSections, ...] | None = None
        self._sha256: bytes | None = None
        #: the whole representation, when it is one contiguous buffer
        self._whole: memoryview | None = None

    @classmethod
    def _over(
        cls,
        header: ContainerHeader,
        buffer: memoryview,
        digests: Sequence[bytes] | None = None,
        sha256: bytes | None = None,
    ) -> Container:
        """A container whose whole representation is the contiguous ``buffer`` (its layer
        digests and SHA-256, when already computed, given)."""
        split = header.header_octets
        container = cls(header, buffer[:split], (buffer[split:],), digests)
        container._whole = buffer
        container._sha256 = sha256
        return container

    @property
    def layers(self) -> tuple[LayerSections, ...]:
        """Zero-copy views of every layer, in ascending order (made on first use)."""
        if self._layers is None:
            header, data = self.header, self._data
            if len(data) == 1:
                self._layers = tuple(_layers(header, data[0], 0, header.layer_count))
            else:
                first = header.first_layer
                self._layers = tuple(
                    LayerSections(
                        first + i, data[2 * i], data[2 * i + 1], header.offset_of(first + i)
                    )
                    for i in range(header.layer_count)
                )
        return self._layers

    @classmethod
    def parse(
        cls,
        data: bytes | bytearray | memoryview,
        geometry: Geometry | None = None,
        max_octets: int = DEFAULT_MAX_CONTAINER_OCTETS,
    ) -> Container:
        """Validate a whole container held in memory; the layers view ``data``."""
        try:
            view = memoryview(data).cast("B")
        except TypeError as exc:
            raise ContainerError(f"container must be a contiguous octet buffer: {exc}") from None
        header = _read_header(view, max_octets)
        if header is None:
            raise ContainerTruncatedError(f"{len(view)} octets is shorter than the header")
        header.check(geometry)
        if len(view) < header.total_octets:
            raise ContainerTruncatedError(
                f"container announces {header.total_octets} octets, got {len(view)}"
            )
        if len(view) > header.total_octets:
            raise ContainerTrailingDataError(
                f"{len(view) - header.total_octets} octets after the last section"
            )
        return cls._over(header, view)

    @classmethod
    def build(
        cls,
        first_layer: int,
        token_count: int,
        sections: Sequence[tuple[Section, Section]],
        codec: int = CODEC_RAW,
        geometry: Geometry | None = None,
    ) -> Container:
        """Encode per-layer (K, V) sections, computing every layer digest; copies no data."""
        if not 0 <= first_layer <= _U32_MAX or not 0 <= token_count <= _U32_MAX:
            raise ContainerHeaderError("first layer and token count must fit in 32 bits")
        views = [(section_octets(k), section_octets(v)) for k, v in sections]
        sha256 = hashlib.sha256
        digests = []
        for k, v in views:
            h = sha256(k)
            h.update(v)
            digests.append(h.digest())
        header = ContainerHeader(
            codec, first_layer, token_count, tuple((len(k), len(v)) for k, v in views)
        )
        header.check(geometry)
        data = [part for pair in views for part in pair]
        return cls(header, header.encode(), data, digests)

    @property
    def parts(self) -> tuple[bytes | memoryview, ...]:
        """The representation as buffers to write in order (no copy)."""
        return (self._header_octets, *self._data)

    @property
    def size(self) -> int:
        return self.header.total_octets

    def data(self) -> memoryview:
        """The octets of every layer, header excluded, as one buffer: a view of a parsed
        container's data region, a join (one copy) of a built container's sections."""
        if len(self._data) == 1:
            return self._data[0]
        return memoryview(b"".join(self._data))

    def tobytes(self) -> bytes:
        """The representation as one ``bytes`` (the one copy of the data)."""
        return b"".join(self.parts)

    def sha256(self) -> bytes:
        """SHA-256 of the representation, for ``Repr-Digest``. Over one buffer, the layer
        digests not known yet are computed in the same pass (whoever checks or stores a block
        needs both, and the second lane makes them nearly free)."""
        if self._sha256 is None:
            if self._whole is None:
                h = hashlib.sha256()
                for part in self.parts:
                    h.update(part)
                self._sha256 = h.digest()
            else:
                spans = [] if self._digests is not None else [x.span for x in self.layers]
                self._sha256, *layers = sha256_ranges(self._whole, [(0, self.size), *spans])
                if self._digests is None:
                    self._digests = tuple(layers)
        return self._sha256

    def _hash_layers(self) -> tuple[bytes, ...]:
        """Every layer's digest, hashed from the octets now (two at a time over one buffer)."""
        if self._whole is None:
            return tuple(layer.digest() for layer in self.layers)
        return tuple(sha256_ranges(self._whole, [layer.span for layer in self.layers]))

    def layer_digests(self) -> tuple[bytes, ...]:
        if self._digests is None:
            self._digests = self._hash_layers()
        return self._digests

    def digest(self) -> bytes:
        """The replica digest; equals the record's ``digest`` only for a full-layer container."""
        return replica_digest(self.layer_digests())

    def verify(self, layer_digests: Sequence[bytes], replica: bytes | None = None) -> None:
        """Check every layer against the record's per-layer digests (indexed by layer number)
        and, when given, that list against the record's replica digest."""
        if replica is not None and replica_digest(layer_digests) != replica:
            raise DigestError("layer digests do not match the replica digest")
        got = self._hash_layers()  # from the octets, whatever was computed before
        _check_layers(self.header.first_layer, got, layer_digests)
        self._digests = got

    def slice(self, first: int, last: int) -> Container:
        """Layers ``first``..``last`` (inclusive, absolute numbers) as a container that views
        this one's data: a new header and no copy."""
        sub = self.header.sliced(first, last)
        lo = first - self.header.first_layer
        hi = lo + sub.layer_count
        digests = None if self._digests is None else self._digests[lo:hi]
        if len(self._data) == 1:
            start = self.header.offset_of(first) - self.header.header_octets
            data: tuple[memoryview, ...] = (self._data[0][start : start + sub.data_octets],)
        else:
            data = self._data[2 * lo : 2 * hi]
        return Container(sub, sub.encode(), data, digests)


class ContainerParser:
    """Incremental parser: get each layer once its octets are in.

    Either ``feed`` it chunks of any size (the buffer for the whole container is allocated
    once, when the header has arrived and its announced size is within ``max_octets``), or let
    the octets land in a buffer of the caller's and tell it how far that is filled with
    ``received`` (no copy at all). Returned layers view the buffer. Octets are hashed as they
    arrive: each call hashes what came since the last. With ``expected_digests`` (the record's
    layer digests, indexed by layer number) each layer is verified as it completes, before it
    is returned. With ``whole_digest`` the SHA-256 of the whole container (``sha256``, for
    ``Repr-Digest``) is computed alongside, on the lane beside the layers' (about one pass for
    both). One parser takes one of the two ways, not both.
    """

    __slots__ = (
        "_buffer",
        "_emitted",
        "_expected",
        "_filled",
        "_geometry",
        "_hasher",
        "_head",
        "_max",
        "_pending",
        "_view",
        "_whole_digest",
        "digests",
        "header",
        "sha256",
    )

    def __init__(
        self,
        geometry: Geometry | None = None,
        max_octets: int = DEFAULT_MAX_CONTAINER_OCTETS,
        expected_digests: Sequence[bytes] | None = None,
        whole_digest: bool = False,
    ) -> None:
        self._geometry = geometry
        self._max = max_octets
        self._expected = expected_digests
        self._whole_digest = whole_digest
        self.sha256: bytes | None = None
        self._head = bytearray()
        self._buffer: bytearray | None = None
        self._view = memoryview(b"")
        self._filled = 0
        self._emitted = 0
        self._hasher: RangeHasher | None = None
        #: the digests of layers complete but not returned yet, by position
        self._pending: dict[int, bytes] = {}
        self.header: ContainerHeader | None = None
        self.digests: list[bytes] = []

    @property
    def complete(self) -> bool:
        return self.header is not None and self._filled == self.header.total_octets

    def feed(self, chunk: bytes | bytearray | memoryview) -> list[LayerSections]:
        data = memoryview(chunk).cast("B")
        if self.header is not None:
            return self._take(self.header, data)
        # Until the header is complete, octets wait in a small side buffer; a chunk that holds
        # the whole header is read in place, so its data is copied only into the container.
        pending = data
        if self._head:
            self._head = self._head + data  # a new buffer: no view of the old one can block it
            pending = memoryview(self._head)
        header = _read_header(pending, self._max)
        if header is None:
            if pending is data:
                self._head = bytearray(data)
            return []
        header.check(self._geometry)
        self._buffer = bytearray(header.total_octets)
        self._start(header, memoryview(self._buffer))
        self._head = bytearray()
        return self._take(header, pending)

    def received(self, buffer: memoryview, filled: int) -> list[LayerSections]:
        """The first ``filled`` octets of the container are in ``buffer`` (the same buffer at
        every call; it must be able to hold the whole container): the layers completed since
        the last call, each checked."""
        before = self._emitted
        self.advance(buffer, filled)
        return self._views(before)

    def advance(self, buffer: memoryview, filled: int) -> int:
        """``received`` without views of the layers (for a caller that wants the container
        only): how many layers are complete and checked."""
        header = self.header
        if header is None:
            header = _read_header(buffer[:filled], self._max)
            if header is None:
                return 0
            header.check(self._geometry)
            if header.total_octets > len(buffer):
                raise ContainerLengthError(
                    f"container announces {header.total_octets} octets; {len(buffer)} arrive"
                )
            self._start(header, buffer[: header.total_octets])
        if filled > header.total_octets:
            raise ContainerTrailingDataError(
                f"{filled - header.total_octets} octets after the last section"
            )
        self._filled = filled
        self._check(header)
        return self._emitted

    def _start(self, header: ContainerHeader, view: memoryview) -> None:
        self.header = header
        self._view = view
        spans = []
        pos = header.header_octets
        for k, v in header.lengths:
            spans.append((pos, pos + k + v))
            pos += k + v
        whole = [(0, header.total_octets)] if self._whole_digest else []
        self._hasher = RangeHasher(header.total_octets, [*whole, *spans])

    def _take(self, header: ContainerHeader, data: memoryview) -> list[LayerSections]:
        room = header.total_octets - self._filled
        if len(data) > room:
            raise ContainerTrailingDataError(f"{len(data) - room} octets after the last section")
        self._view[self._filled : self._filled + len(data)] = data
        self._filled += len(data)
        before = self._emitted
        self._check(header)
        return self._views(before)

    def _check(self, header: ContainerHeader) -> None:
        """Hash what arrived since the last call; check the layers it completed, in order."""
        assert self._hasher is not None
        first = 1 if self._whole_digest else 0  # the hasher's range 0 is the whole container
        for index in self._hasher.advance(self._view, self._filled):
            if index < first:
                self.sha256 = self._hasher.digest(index)
            else:
                self._pending[index - first] = self._hasher.digest(index)
        ready = self._emitted
        while ready in self._pending:
            ready += 1
        got = [self._pending.pop(i) for i in range(self._emitted, ready)]
        if self._expected is not None:
            _check_layers(header.first_layer + self._emitted, got, self._expected)
        self.digests.extend(got)
        self._emitted = ready

    def _views(self, start: int) -> list[LayerSections]:
        """Views of the layers checked from position ``start`` on."""
        if self.header is None or start == self._emitted:
            return []
        data = self._view[self.header.header_octets :]
        return _layers(self.header, data, start, self._emitted)

    def finish(self) -> Container:
        """The whole container; raises if octets are missing."""
        if self.header is None or not self.complete:
            got = self._filled if self.header is not None else len(self._head)
            want = "a full header" if self.header is None else f"{self.header.total_octets} octets"
            raise ContainerTruncatedError(f"container ended after {got} octets, expected {want}")
        return Container._over(self.header, self._view, self.digests, self.sha256)
