"""The engine on the real model: blocks leave and enter bit-exactly, an importer continues with
the exporter's logits, a cached prefix gives the tokens of a full recompute, samplers replay."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsp.core.container import Container
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
