"""What a holder knows about one stored block, independent of where its octets live.

A block is identified by (compat, scope, block_key), all lower-case hex as on the wire. Its
``BlockMeta`` carries everything needed to rebuild a container header for any layer range and to
verify any layer read back from a tier: the codec, the token count, every layer's section
lengths and every layer's digest. The octets of a layer range are the K and V sections of those
layers, back to back, exactly as they follow the header in a KVB1 container.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

from kvsp.core.container import Container, ContainerHeader, layer_digest, replica_digest
from kvsp.core.problems import ContainerError, DigestError, RecordError

__all__ = ["MAX_BLOCK_OCTETS", "BlockId", "BlockMeta", "block_ref", "verify_layers"]

#: the largest container a holder stores and a client receives, unless configured otherwise
MAX_BLOCK_OCTETS = 256 << 20

#: (compat_id, scope_id, block_key), lower-case hex.
BlockId = tuple[str, str, str]


def block_ref(block: BlockId) -> str:
    """The block's resource path below a holder's base URL (also used in logs)."""
    compat, scope, key = block
    return f"blocks/{compat}/{scope}/{key}"


@dataclass(frozen=True, slots=True)
class BlockMeta:
    codec: int
    token_count: int
    lengths: tuple[tuple[int, int], ...]
    layer_digests: tuple[bytes, ...]
    #: data offset of each layer's K section, and the end, relative to layer 0
    offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)
    #: the Replica Record members a holder republishes on every move, computed once:
    #: octets of the whole block's container, its digest and the hex layer digests
    size: int = field(init=False, repr=False, compare=False)
    digest_text: str = field(init=False, repr=False, compare=False)
    layer_digests_hex: tuple[str, ...] = field(init=False, repr=False, compare=False)
    #: the whole block's container header, served with every whole-block GET
    whole_header: ContainerHeader = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ends = itertools.accumulate((k + v for k, v in self.lengths), initial=0)
        object.__setattr__(self, "offsets", tuple(ends))
        whole = ContainerHeader(self.codec, 0, self.token_count, self.lengths)
        object.__setattr__(self, "whole_header", whole)
        object.__setattr__(self, "size", whole.total_octets)
        object.__setattr__(self, "digest_text", "sha-256:" + self.digest.hex())
        object.__setattr__(self, "layer_digests_hex", tuple(d.hex() for d in self.layer_digests))

    @classmethod
    def of(cls, container: Container) -> BlockMeta:
        """The meta of a whole block given as a container of all its layers (from layer 0)."""
        header = container.header
        if header.first_layer != 0:
            raise ContainerError(
                f"a stored block holds every layer from 0; this container starts at layer "
                f"{header.first_layer}"
            )
        return cls(header.codec, header.token_count, header.lengths, container.layer_digests())

    @property
    def layer_count(self) -> int:
        return len(self.lengths)

    @property
    def digest(self) -> bytes:
        return replica_digest(self.layer_digests)

    def header(self, first: int, last: int) -> ContainerHeader:
        if (first, last) == (0, len(self.lengths) - 1):
            return self.whole_header
        return ContainerHeader(self.codec, first, self.token_count, self.lengths[first : last + 1])

    def range_octets(self, first: int, last: int) -> int:
        return self.offsets[last + 1] - self.offsets[first]

    def to_json(self) -> dict[str, Any]:
        return {
            "codec": self.codec,
            "token_count": self.token_count,
            "lengths": [list(pair) for pair in self.lengths],
            "layer_digests": list(self.layer_digests_hex),
        }

    @classmethod
    def from_json(cls, text: str | bytes) -> BlockMeta:
        """Meta written by ``to_json``; anything malformed is a ``RecordError``."""
        try:
            doc = json.loads(text)
            lengths = tuple((int(k), int(v)) for k, v in doc["lengths"])
            digests = tuple(bytes.fromhex(d) for d in doc["layer_digests"])
            meta = cls(int(doc["codec"]), int(doc["token_count"]), lengths, digests)
        except (ValueError, KeyError, TypeError) as exc:
            raise RecordError(f"unreadable block meta: {exc!r}") from None
        if len(lengths) != len(digests) or not lengths or any(len(d) != 32 for d in digests):
            raise RecordError("block meta: one 32-octet digest per layer is required")
        return meta


def verify_layers(meta: BlockMeta, first: int, last: int, data: memoryview) -> None:
    """Check ``data``, the octets of layers ``first..last``, against the meta's layer digests;
    ``DigestError`` names the first layer that differs."""
    if len(data) != meta.range_octets(first, last):
        raise DigestError(f"layers {first}-{last}: {len(data)} octets stored, expected more")
    base = meta.offsets[first]
    for layer in range(first, last + 1):
        start = meta.offsets[layer] - base
        k, v = meta.lengths[layer]
        got = layer_digest(data[start : start + k], data[start + k : start + k + v])
        if got != meta.layer_digests[layer]:
            raise DigestError(f"layer {layer}: stored octets do not match their digest")
