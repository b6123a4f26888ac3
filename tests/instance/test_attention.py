"""The engine's grouped attention gives transformers' ``sdpa`` output bit for bit: with a mask
(a prompt's rest after a cached prefix), causal without one (a prefill), and one query row
(decoding); and on the real model the engine's logits are those of the model loaded plainly
(both computing the last token's logits only: the vocabulary projection of one row rounds
differently from that of many)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvsp.instance.attention import grouped_sdpa
from kvsp.instance.engine import Engine, KvState
from kvsp.model import ModelFiles


class Layer(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 3


def attend(function: Any, rows: int, cached: int, mask: torch.Tensor | None) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rows * 1000 + cached)
    query = torch.randn(1, 9, rows, 64, generator=generator)
    key, value = (torch.randn(1, 3, cached, 64, generator=generator) for _ in range(2))
    out: torch.Tensor = function(Layer(), query, key, value, mask, scaling=0.125)[0]
    return out


@pytest.mark.parametrize(
    ("rows", "cached", "masked"),
    [(16, 2048, True), (16, 160, True), (64, 64, False), (1, 2049, False), (3, 300, True)],
)
def test_grouped_attention_gives_the_bits_of_repeated_heads(
    rows: int, cached: int, masked: bool
) -> None:
    mask = None
    if masked:  # row i sees the cached tokens and the rows up to itself
        mask = torch.ones(rows, cached, dtype=torch.bool).tril(cached - rows)[None, None]
    ours = attend(grouped_sdpa, rows, cached, mask)
    theirs = attend(sdpa_attention_forward, rows, cached, mask)
    assert ours.shape == (1, rows, 9, 64)
    assert torch.equal(ours, theirs)


def test_the_engine_computes_the_logits_of_the_plainly_loaded_model(
    engine: Engine, model_files: ModelFiles
) -> None:
    prompt = [(13 * i + 5) % 40_000 + 100 for i in range(80)]
    plain = AutoModelForCausalLM.from_pretrained(
        model_files.weights, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    state, cache = KvState(), DynamicCache()
    with torch.inference_mode():
        for chunk in (prompt[:64], prompt[64:], [4321]):  # prefill, the rest on a past, a decode
            ours = engine.forward(state, chunk)
            out = plain(
                torch.tensor([chunk]), past_key_values=cache, use_cache=True, logits_to_keep=1
            )
            assert np.array_equal(ours, out.logits[0, -1].numpy())
