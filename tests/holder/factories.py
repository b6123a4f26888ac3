"""Blocks for holder tests: small containers with distinct, reproducible octets."""

from __future__ import annotations

import hashlib

from kvsp.core.container import Container
from kvsp.holder.blocks import BlockId, BlockMeta

COMPAT = "c0" * 32
SCOPE = "a1" * 16
OTHER_SCOPE = "b2" * 16


def block_id(n: int, scope: str = SCOPE) -> BlockId:
    return COMPAT, scope, hashlib.sha256(b"block %d" % n).hexdigest()


def container(n: int, layers: int = 4, section: int = 64, tokens: int = 4) -> Container:
    """A raw container whose every section is different (seeded by ``n``)."""
    sections = []
    for layer in range(layers):
        k = hashlib.sha256(b"k %d %d" % (n, layer)).digest() * (section // 32)
        v = hashlib.sha256(b"v %d %d" % (n, layer)).digest() * (section // 32)
        sections.append((k, v))
    return Container.parse(Container.build(0, tokens, sections).tobytes())


def stored(n: int, layers: int = 4, section: int = 64) -> tuple[BlockMeta, memoryview, bytes]:
    """(meta, data of every layer, the whole container octets) of block ``n``."""
    c = container(n, layers, section)
    octets = c.tobytes()
    return BlockMeta.of(c), memoryview(octets)[c.header.header_octets :], octets
