"""kvsp's copy of vLLM's KV event format against the pinned vLLM's own classes: every batch
kvsp encodes decodes with vLLM's decoder to the same events, and every batch vLLM encodes
decodes with kvsp's."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from vllm.distributed import kv_events as vllm_events

from kvsp.kvevents import wire

hashes = st.integers(0, (1 << 64) - 1)
tokens = st.lists(st.integers(0, (1 << 32) - 1), min_size=1, max_size=64)
media = st.sampled_from(["GPU", "CPU", "STORAGE", None])
optional_text = st.none() | st.text(max_size=8)
stored = st.fixed_dictionaries(
    {
        "block_hashes": st.lists(hashes, min_size=1, max_size=4),
        "parent_block_hash": st.none() | hashes,
        "token_ids": tokens,
        "block_size": st.just(16),
        "lora_id": st.none(),
        "medium": media,
        "lora_name": st.none(),
        "extra_keys": st.none() | st.just([("a-scope",)]),
        "session_id": optional_text,
    }
)
removed = st.fixed_dictionaries(
    {"block_hashes": st.lists(hashes, min_size=1, max_size=4), "medium": media}
)
events = st.lists(
    st.one_of(
        stored.map(lambda d: ("BlockStored", d)),
        removed.map(lambda d: ("BlockRemoved", d)),
        st.just(("AllBlocksCleared", {})),
    ),
    max_size=6,
)


def build(module: object, kind: str, fields: dict[str, object]) -> object:
    return getattr(module, kind)(**fields)


@given(events, st.floats(0, 2e9), st.none() | st.integers(0, 7))
def test_kvsp_and_vllm_decode_each_others_batches(
    spec: list[tuple[str, dict[str, object]]], ts: float, rank: int | None
) -> None:
    ours = wire.EventBatch(ts, [build(wire, k, f) for k, f in spec], rank)  # type: ignore[misc]
    theirs = vllm_events.KVEventBatch(
        ts=ts, events=[build(vllm_events, k, f) for k, f in spec], data_parallel_rank=rank
    )
    ours_octets = wire.encode_batch(ours)
    theirs_octets = msgspec.msgpack.Encoder().encode(theirs)
    assert ours_octets == theirs_octets  # the same octets, field for field
    decoded = msgspec.msgpack.Decoder(vllm_events.KVEventBatch).decode(ours_octets)
    assert msgspec.to_builtins(decoded) == msgspec.to_builtins(theirs)
    assert wire.decode_batch(theirs_octets) == ours


def test_a_batch_that_is_not_one_is_refused() -> None:
    with pytest.raises(msgspec.ValidationError):
        wire.decode_batch(msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]))
    with pytest.raises(msgspec.DecodeError):
        wire.decode_batch(b"\xc1")


def test_the_block_hash_is_the_low_64_bits_of_the_key_as_vllm_reduces_its_own() -> None:
    key = bytes(range(32))
    assert wire.external_hash(key) == int.from_bytes(key, "big") & ((1 << 64) - 1)
    assert wire.END_SEQ == vllm_events.ZmqEventPublisher.END_SEQ
    assert set(wire.MEDIUM_OF_TIER.values()) == {
        vllm_events.MEDIUM_GPU, vllm_events.MEDIUM_CPU, vllm_events.MEDIUM_STORAGE
    }  # fmt: skip
