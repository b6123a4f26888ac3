"""The engine on the real model: blocks leave and enter bit-exactly, an importer continues with
the exporter's logits, a cached prefix gives the tokens of a full recompute, samplers replay."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsp.core.container import Container
from kvsp.core.problems import ContainerError
from kvsp.core.records import Sampler
from kvsp.instance.engine import Engine, KvState
from kvsp.model import ModelFiles

PROMPT = [(7 * i + 11) % 40_000 + 100 for i in range(64)]  # four blocks of 16


def chat_prompt(engine: Engine, text: str) -> list[int]:
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if not isinstance(ids, list) else ids)


def test_a_block_round_trips_through_a_container_bit_exactly(engine: Engine) -> None:
    state = KvState()
    engine.forward(state, PROMPT)
    blocks = [Container.parse(engine.export_block(state, i).tobytes()) for i in range(4)]
    assert blocks[1].size == 20 + 16 * 30 + 30 * 2 * 16 * 3 * 64 * 4  # 737,780 octets
    restored = engine.state_from_blocks(blocks, PROMPT)
    for a, b in zip(state.cache.layers, restored.cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys)
        assert torch.equal(a.values, b.values)
    again = engine.export_block(restored, 2)
    assert again.tobytes() == blocks[2].tobytes()


def test_an_importing_engine_continues_with_the_exporters_logits(
    engine: Engine, model_files: ModelFiles
) -> None:
    exporter = KvState()
    engine.forward(exporter, PROMPT)
    wire = [engine.export_block(exporter, i).tobytes() for i in range(4)]
    other = Engine(model_files)  # a second engine, as another instance would have
    importer = other.state_from_blocks([Container.parse(w) for w in wire], PROMPT)
    token = 1234
    for _ in range(4):
        a = engine.forward(exporter, [token])
        b = other.forward(importer, [token])
        assert np.array_equal(a, b)  # bit-identical
        token = int(np.argmax(a))


def test_a_cached_prefix_gives_the_tokens_of_a_full_recompute(engine: Engine) -> None:
    prompt = chat_prompt(engine, "Name three colours of the rainbow, briefly.")
    cut = (len(prompt) - 1) // 16 * 16
    greedy = Sampler(method="greedy", deterministic=True)
    fresh = list(engine.generate(KvState(), prompt, greedy, 12))
    source = KvState()
    engine.forward(source, prompt[:cut])
    blocks = [engine.export_block(source, i) for i in range(cut // 16)]
    cached = engine.state_from_blocks(blocks, prompt[:cut])
    reused = list(engine.generate(cached, prompt[cut:], greedy, 12))
    assert reused == fresh


def test_blocks_added_as_they_arrive_in_any_order_give_the_state_of_all_at_once(
    engine: Engine,
) -> None:
    exporter = KvState()
    engine.forward(exporter, PROMPT)
    blocks = [engine.export_block(exporter, i) for i in range(4)]
    prefix = engine.prefix(len(PROMPT) + 5)
    for index in (2, 0, 3, 1):
        prefix.add(index, Container.parse(blocks[index].tobytes()))
    arrived = prefix.state(PROMPT)
    whole = engine.state_from_blocks(blocks, PROMPT)
    assert np.array_equal(engine.forward(arrived, [99]), engine.forward(whole, [99]))
    assert np.array_equal(engine.forward(arrived, [5, 6, 7]), engine.forward(whole, [5, 6, 7]))


def test_a_prefix_state_holds_only_the_first_blocks_and_only_added_ones(engine: Engine) -> None:
    exporter = KvState()
    engine.forward(exporter, PROMPT)
    prefix = engine.prefix(len(PROMPT))
    prefix.add(0, engine.export_block(exporter, 0))
    prefix.add(2, engine.export_block(exporter, 2))  # past the prefix's end: left unread
    assert len(prefix.state(PROMPT[:16])) == 16
    with pytest.raises(ValueError, match="first blocks added"):
        prefix.state(PROMPT[:48])  # block 1 never came
    with pytest.raises(ValueError, match="first blocks added"):
        prefix.state(PROMPT[:20])  # not whole blocks
    with pytest.raises(ValueError, match="made room for"):
        prefix.add(4, engine.export_block(exporter, 3))
    with pytest.raises(ContainerError, match="16 tokens"):
        prefix.add(1, engine.export_range(exporter, 16, 24))


def test_an_empty_prefix_generates_as_a_fresh_state_does(engine: Engine) -> None:
    greedy = Sampler(method="greedy", deterministic=True)
    fresh = list(engine.generate(KvState(), PROMPT, greedy, 6))
    made_room = engine.prefix(len(PROMPT) + 6).state([])
    assert list(engine.generate(made_room, PROMPT, greedy, 6)) == fresh


@pytest.mark.parametrize(
    "sampler",
    [
        Sampler(method="temperature", params={"temperature": 0.8}, seed=5),
        Sampler(method="top-k", params={"k": 20, "temperature": 0.9}, seed=6),
        Sampler(method="top-p", params={"p": 0.9}, seed=7),
    ],
)
def test_a_resumed_sampler_draws_what_the_original_would_have(
    engine: Engine, sampler: Sampler
) -> None:
    prompt = chat_prompt(engine, "Write one short sentence about the sea.")
    whole = list(engine.generate(KvState(), prompt, sampler, 10))
    first = whole[:4]
    # resume at step 4 from a recomputed cache of the prompt and the first four tokens
    resumed = list(engine.generate(KvState(), prompt + first, sampler, 6, first_step=4))
    assert first + resumed == whole[: 4 + len(resumed)]
