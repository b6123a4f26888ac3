"""A ``GrowingLayer`` holds what transformers' ``DynamicLayer`` holds after any run of appends,
crops, batch selections and resets (hypothesis), writes appends in place while its buffers
have room, and keeps its contents when it moves to larger ones; an engine's imported prefix
is appended to in place."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicLayer

from kvsp.instance.engine import Engine, KvState
from kvsp.instance.growing_cache import MIN_SPARE_TOKENS, GrowingCache, GrowingLayer, room_for

HEADS, HEAD_DIM = 3, 4


def states(tokens: int, seed: int, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, HEADS, tokens, HEAD_DIM)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def same(ours: GrowingLayer, theirs: DynamicLayer) -> bool:
    if ours.get_seq_length() != theirs.get_seq_length():
        return False
    if not theirs.get_seq_length():
        return True
    assert ours.keys is not None
    assert ours.values is not None
    return torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


operations = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 90)),
        st.tuples(st.just("crop"), st.integers(1, 20)),
        st.tuples(st.just("select"), st.just(0)),
        st.tuples(st.just("reset"), st.just(0)),
    ),
    min_size=1,
    max_size=25,
)


@settings(max_examples=60, deadline=None)
@given(operations)
def test_a_growing_layer_holds_what_a_dynamic_layer_holds(ops: list[tuple[str, int]]) -> None:
    ours, theirs = GrowingLayer(), DynamicLayer()
    for step, (op, n) in enumerate(ops):
        if op == "append":
            keys, values = states(n, step, batch=2)
            answered = ours.update(keys, values)
            expected = theirs.update(keys, values)
            assert torch.equal(answered[0], expected[0])
            assert torch.equal(answered[1], expected[1])
        elif op == "crop" and theirs.get_seq_length() > n:
            ours.crop(-n)
            theirs.crop(-n)
        elif op == "select" and theirs.get_seq_length():
            ours.batch_select_indices(torch.tensor([1, 0]))  # replaces the layer's tensors
            theirs.batch_select_indices(torch.tensor([1, 0]))
        elif op == "reset":
            ours.reset()
            theirs.reset()
        assert same(ours, theirs)


def test_appends_are_written_in_place_while_there_is_room() -> None:
    layer = GrowingLayer()
    layer.update(*states(100, 1))
    assert layer.keys is not None
    start = layer.keys.data_ptr()
    for step in range(room_for(100) - 100):
        layer.update(*states(1, 2 + step))
        assert layer.keys.data_ptr() == start
    assert layer.get_seq_length() == room_for(100)
    held = layer.keys.clone()
    layer.update(*states(1, 999))  # no room left: a larger buffer, the same contents
    assert layer.keys.data_ptr() != start
    assert torch.equal(layer.keys[:, :, :-1], held)


def test_buffers_have_an_eighth_spare_and_at_least_the_minimum() -> None:
    assert room_for(16) == 16 + MIN_SPARE_TOKENS
    assert room_for(2048) == 2048 + 256


def test_adopted_buffers_must_hold_the_tokens() -> None:
    rooms = torch.zeros(1, HEADS, 10, HEAD_DIM)
    with pytest.raises(ValueError, match="holding the tokens"):
        GrowingLayer().adopt(rooms, rooms.clone(), 11)
    with pytest.raises(ValueError, match="one shape"):
        GrowingLayer().adopt(rooms, torch.zeros(1, HEADS, 9, HEAD_DIM), 5)


def test_a_cache_made_empty_adds_growing_layers() -> None:
    cache = GrowingCache()
    cache.update(*states(5, 3), 1)
    assert [type(layer) for layer in cache.layers] == [GrowingLayer, GrowingLayer]
    assert cache.get_seq_length(1) == 5


def test_an_imported_prefix_is_appended_to_in_place(engine: Engine) -> None:
    prompt = [(11 * i + 3) % 40_000 + 100 for i in range(48)]
    source = KvState()
    engine.forward(source, prompt[:32])
    blocks = [engine.export_block(source, i) for i in range(2)]
    state = engine.state_from_blocks(blocks, prompt[:32])
    pointers = [layer.keys.data_ptr() for layer in state.cache.layers]
    engine.forward(state, prompt[32:])
    assert [layer.keys.data_ptr() for layer in state.cache.layers] == pointers
    assert state.cache.get_seq_length() == 48
