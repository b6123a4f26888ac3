"""vLLM's KV event wire format, pure: the msgpack ``EventBatch`` and its three events.

The routers and indexers kvsp's users run (llm-d's kv-cache indexer, Dynamo's KV router and
standalone indexer, Mooncake's Conductor) read vLLM's ZMQ KV events: each message is three
frames, ``[topic, sequence (8 octets, big-endian), EventBatch]``, and a ROUTER socket answers a
replay request (the first sequence number wanted) with the buffered messages, then an end mark
(sequence -1, empty frames). The structs here keep the field names, order and msgspec options
of the pinned vLLM's ``vllm.distributed.kv_events`` (tests check that each side decodes the
other's octets), so kvsp speaks the format without importing vLLM.

Block hashes are 64-bit integers, as vLLM sends them by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``: the low 64 bits of its hash). kvsp sends the low 64
bits of the Block Key, a keyed HMAC: docs/decisions/0021 says why that tells a subscriber
nothing beyond the token ids it already receives.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "END_SEQ",
    "MEDIUM_OF_TIER",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KvEvent",
    "decode_batch",
    "encode_batch",
    "external_hash",
    "seq_octets",
]

#: the replay socket's end mark: sequence -1 as a signed 8-octet integer
END_SEQ = (-1).to_bytes(8, "big", signed=True)

#: kvsp's tiers as vLLM names the media ("GPU", "CPU", "STORAGE")
MEDIUM_OF_TIER = {"device": "GPU", "host": "CPU", "disk": "STORAGE"}


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Tagged by class name (``{"type": "BlockStored", ...}``), as vLLM's ``KVCacheEvent``."""


class BlockStored(_Event):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_Event):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(EventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(octets: bytes | memoryview) -> EventBatch:
    """The batch in ``octets``; ``msgspec.ValidationError`` / ``DecodeError`` otherwise."""
    return _decoder.decode(octets)


def external_hash(block_key: bytes) -> int:
    """The block hash a subscriber sees: the low 64 bits, as vLLM reduces its own hashes."""
    return int.from_bytes(block_key[-8:], "big")


def seq_octets(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)
