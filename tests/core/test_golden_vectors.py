"""Golden vectors, each built here by explicit byte concatenation with hashlib/hmac/struct.

These are an independent path: the expected octets never come from the code under test, and
the hex literals pin them so a change in either path is caught.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from kvsp.core.compat import CompatibilityDescriptor
from kvsp.core.container import Container
from kvsp.core.keys import BlockKeyChain, block_keys, scope_id

MODEL_DIGEST = "sha-256:" + "1" * 64
TOKENIZER_DIGEST = "sha-256:" + "2" * 64
DESCRIPTOR = {
    "model": "SmolLM2-135M-Instruct",
    "model_digest": MODEL_DIGEST,
    "tokenizer_digest": TOKENIZER_DIGEST,
    "layers": 30,
    "kv_heads": 3,
    "head_dim": 64,
    "kv_dtype": "float32",
    "positional": "rope;theta=100000",
    "block_tokens": 16,
    "layout": "kvsp-layout-1",
}
# JCS by hand: members sorted by UTF-16 code units, no whitespace.
CANONICAL = (
    b'{"block_tokens":16,"head_dim":64,"kv_dtype":"float32","kv_heads":3,"layers":30,'
    b'"layout":"kvsp-layout-1","model":"SmolLM2-135M-Instruct",'
    b'"model_digest":"' + MODEL_DIGEST.encode() + b'","positional":"rope;theta=100000",'
    b'"tokenizer_digest":"' + TOKENIZER_DIGEST.encode() + b'"}'
)
COMPAT_HEX = "fdf213b0905f3efdc9b2ac4a8191641ed22f0947a5ea92f308dd85c6fcfb2de9"
SCOPE_KEY = bytes(range(32))
SCOPE_HEX = "6d1c6481cd428737da312c089db3832a"
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 4294967295, 0]  # two blocks of 4 and a partial block
KEY_HEX = [
    "1ee78ccd51f24abd491a314e1664fab72a19ba937ee39e9ad0ef468cb00e94aa",
    "495f0119a9e34fbb45cdb517b60beb2d9f6dff2ead02d0d561576dd1890beae4",
]


def test_compat_id() -> None:
    expected = hashlib.sha256(b"KVSP-COMPAT-1" + b"\x00" + CANONICAL).digest()
    descriptor = CompatibilityDescriptor.parse(DESCRIPTOR)
    assert descriptor.canonical() == CANONICAL
    assert descriptor.compat_id() == expected
    assert expected.hex() == COMPAT_HEX


def test_compat_id_does_not_depend_on_member_order() -> None:
    reordered = dict(reversed(list(DESCRIPTOR.items())))
    assert CompatibilityDescriptor.parse(reordered).compat_id().hex() == COMPAT_HEX


def test_scope_id() -> None:
    expected = hashlib.sha256(b"KVSP-SCOPE-1" + b"\x00" + SCOPE_KEY).digest()[:16]
    assert scope_id(SCOPE_KEY) == expected
    assert expected.hex() == SCOPE_HEX


def _chain_by_hand(tokens: list[int], block: int, parent: bytes = bytes(32)) -> list[bytes]:
    compat = bytes.fromhex(COMPAT_HEX)
    keys = []
    previous = parent
    for i in range(len(tokens) // block):
        message = (
            b"KVSP-BLOCK-1"
            + b"\x00"
            + compat
            + previous
            + struct.pack(f">{block}I", *tokens[i * block : (i + 1) * block])
        )
        previous = hmac.new(SCOPE_KEY, message, hashlib.sha256).digest()
        keys.append(previous)
    return keys


def test_block_key_chain_with_partial_trailing_block() -> None:
    expected = _chain_by_hand(TOKENS, 4)
    assert [k.hex() for k in expected] == KEY_HEX
    got = block_keys(SCOPE_KEY, bytes.fromhex(COMPAT_HEX), TOKENS, 4)  # type: ignore[arg-type]
    assert got == expected


def test_block_key_chain_on_a_shared_parent() -> None:
    parent = bytes.fromhex(KEY_HEX[1])
    expected = _chain_by_hand(TOKENS[:8], 4, parent)
    chain = BlockKeyChain(SCOPE_KEY, bytes.fromhex(COMPAT_HEX), 4, parent)  # type: ignore[arg-type]
    assert chain.extend(TOKENS[:8]) == expected


def test_two_layer_container() -> None:
    token_count, first_layer = 2, 5
    sections = [(bytes([i]) * 24, bytes([i + 16]) * 24) for i in (1, 2)]
    header = struct.pack(">4sBBHIII", b"KVB1", 1, 0, 1, first_layer, 2, token_count)
    header += struct.pack(">4Q", 24, 24, 24, 24)
    expected = header + b"".join(k + v for k, v in sections)
    built = Container.build(first_layer, token_count, sections)
    assert built.tobytes() == expected
    layer_digests = [hashlib.sha256(k + v).digest() for k, v in sections]
    assert list(built.layer_digests()) == layer_digests
    assert built.digest() == hashlib.sha256(b"".join(layer_digests)).digest()
    parsed = Container.parse(expected)
    assert [(layer.layer, bytes(layer.k), bytes(layer.v)) for layer in parsed.layers] == [
        (5, *sections[0]),
        (6, *sections[1]),
    ]
    assert parsed.digest() == built.digest()
