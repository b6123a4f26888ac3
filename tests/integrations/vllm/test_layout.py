"""vLLM's CPU paged layout against kvsp-layout-1: K transposed per (block, head), V as is."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvsp.core.problems import ConfigurationError
from kvsp.integrations.vllm.layout import CpuPagedLayer

HEADS, DIM, PAGE = 3, 8, 32


def cache(blocks: int = 4) -> np.ndarray:
    return np.zeros((blocks, HEADS, PAGE, 2 * DIM), dtype=np.float32)


def test_k_is_stored_transposed_and_v_token_major_in_each_head() -> None:
    memory = cache()
    layer = CpuPagedLayer(memory, HEADS, DIM)
    k = np.arange(2 * HEADS * DIM, dtype=np.float32).reshape(2, HEADS, DIM)
    v = -k
    layer.write(1, 5, k, v)
    head = memory[1, 2].reshape(-1)  # one (block, head): K [DIM, PAGE], then V [PAGE, DIM]
    key_part = head[: PAGE * DIM].reshape(DIM, PAGE)
    value_part = head[PAGE * DIM :].reshape(PAGE, DIM)
    assert np.array_equal(key_part[:, 5:7], k[:, 2, :].T)
    assert np.array_equal(value_part[5:7], v[:, 2, :])
    assert np.count_nonzero(memory[0]) == np.count_nonzero(memory[2:]) == 0


@given(
    block=st.integers(0, 3),
    offset=st.integers(0, PAGE - 1),
    tokens=st.integers(1, PAGE),
    seed=st.integers(0, 2**32 - 1),
)
def test_what_is_written_reads_back_and_touches_nothing_else(
    block: int, offset: int, tokens: int, seed: int
) -> None:
    tokens = min(tokens, PAGE - offset)
    rng = np.random.default_rng(seed)
    memory = rng.random((4, HEADS, PAGE, 2 * DIM), dtype=np.float32)
    before = memory.copy()
    layer = CpuPagedLayer(memory, HEADS, DIM)
    k = rng.random((tokens, HEADS, DIM), dtype=np.float32)
    v = rng.random((tokens, HEADS, DIM), dtype=np.float32)
    layer.write(block, offset, k, v)
    got_k, got_v = layer.read(block, offset, tokens)
    assert np.array_equal(got_k, k)
    assert np.array_equal(got_v, v)
    assert got_k.flags.c_contiguous
    assert got_v.flags.c_contiguous
    others = np.ones(memory.shape, dtype=bool)
    others[block] = False
    assert np.array_equal(memory[others], before[others])
    changed = np.count_nonzero(memory != before)
    assert changed <= 2 * tokens * HEADS * DIM


def test_a_range_past_the_page_and_a_foreign_layout_are_refused() -> None:
    layer = CpuPagedLayer(cache(), HEADS, DIM)
    with pytest.raises(ValueError, match="outside a vLLM block"):
        layer.read(0, PAGE - 2, 4)
    with pytest.raises(ConfigurationError, match="CPU_ATTN"):
        CpuPagedLayer(np.zeros((2, 4, PAGE, HEADS, DIM), np.float32), HEADS, DIM)
    with pytest.raises(ConfigurationError, match="contiguous"):
        CpuPagedLayer(cache()[:, :, :, ::-1], HEADS, DIM)
