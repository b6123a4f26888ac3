"""vLLM's CPU paged layout against kvsp-layout-1: K transposed per (block, head), V as is."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvsp.core.problems import ConfigurationError
from kvsp.integrations.vllm.layout import CpuPagedCache

HEADS, DIM, PAGE, BLOCKS, LAYERS = 3, 8, 32, 4, 5


def together(layers: int = LAYERS) -> list[torch.Tensor]:
    """Layers allocated in one piece, one after the other (as vLLM does)."""
    return list(torch.zeros(layers, BLOCKS, HEADS, PAGE, 2 * DIM).unbind(0))


def apart(layers: int = LAYERS) -> list[torch.Tensor]:
    return [torch.zeros(BLOCKS, HEADS, PAGE, 2 * DIM) for _ in range(layers)]


def sections(k: np.ndarray, v: np.ndarray) -> memoryview:
    """Layers' sections as a container holds them: per layer K then V, [tokens, heads, dim]."""
    return memoryview(bytearray(np.stack([k, v], axis=1).astype(np.float32).tobytes()))


def test_k_is_stored_transposed_and_v_token_major_in_each_head() -> None:
    layers = together()
    cache = CpuPagedCache(layers, HEADS, DIM)
    k = np.arange(2 * HEADS * DIM, dtype=np.float32).reshape(1, 2, HEADS, DIM)
    v = -k
    cache.write(3, 1, 5, 2, sections(k, v))
    head = layers[3][1, 2].reshape(-1).numpy()  # (block 1, head 2): K [DIM, PAGE], V [PAGE, DIM]
    key_part = head[: PAGE * DIM].reshape(DIM, PAGE)
    value_part = head[PAGE * DIM :].reshape(PAGE, DIM)
    assert np.array_equal(key_part[:, 5:7], k[0, :, 2, :].T)
    assert np.array_equal(value_part[5:7], v[0, :, 2, :])
    touched = sum(int(torch.count_nonzero(layer)) for layer in layers)
    assert touched == int(torch.count_nonzero(layers[3][1])) == 2 * 2 * HEADS * DIM - 2


def test_layers_allocated_together_are_one_view() -> None:
    assert CpuPagedCache(together(), HEADS, DIM).views == 1
    assert CpuPagedCache(apart(), HEADS, DIM).views == LAYERS
    mixed = [*together(2), *apart(1), *together(2)]
    assert CpuPagedCache(mixed, HEADS, DIM).views == 3


@given(
    first=st.integers(0, LAYERS - 1),
    count=st.integers(1, LAYERS),
    block=st.integers(0, BLOCKS - 1),
    offset=st.integers(0, PAGE - 1),
    tokens=st.integers(1, PAGE),
    layout=st.sampled_from(["together", "apart", "mixed"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_what_is_written_reads_back_and_touches_nothing_else(
    first: int, count: int, block: int, offset: int, tokens: int, layout: str, seed: int
) -> None:
    count = min(count, LAYERS - first)
    tokens = min(tokens, PAGE - offset)
    rng = np.random.default_rng(seed)
    layers = {
        "together": together,
        "apart": apart,
        "mixed": lambda: [*together(2), *apart(1), *together(2)],
    }[layout]()
    for layer in layers:
        layer.copy_(torch.from_numpy(rng.random(layer.shape, dtype=np.float32)))
    before = [layer.clone() for layer in layers]
    cache = CpuPagedCache(layers, HEADS, DIM)
    k = rng.random((count, tokens, HEADS, DIM), dtype=np.float32)
    v = rng.random((count, tokens, HEADS, DIM), dtype=np.float32)
    cache.write(first, block, offset, tokens, sections(k, v))
    for i in range(count):
        got_k, got_v = cache.read(first + i, block, offset, tokens)
        assert np.array_equal(got_k, k[i])
        assert np.array_equal(got_v, v[i])
        assert got_k.flags.c_contiguous
        assert got_v.flags.c_contiguous
    for i, (layer, old) in enumerate(zip(layers, before, strict=True)):
        others = torch.ones(layer.shape, dtype=torch.bool)
        if first <= i < first + count:
            others[block] = False
        assert torch.equal(layer[others], old[others])
        assert int(torch.count_nonzero(layer != old)) <= 2 * tokens * HEADS * DIM


def test_ranges_outside_the_cache_and_foreign_layouts_are_refused() -> None:
    cache = CpuPagedCache(together(), HEADS, DIM)
    with pytest.raises(ValueError, match="outside a vLLM block"):
        cache.read(0, 0, PAGE - 2, 4)
    one_layer = sections(np.zeros((1, 2, HEADS, DIM)), np.zeros((1, 2, HEADS, DIM)))
    with pytest.raises(ValueError, match="outside the cache"):
        cache.write(LAYERS, 0, 0, 2, one_layer)
    with pytest.raises(ConfigurationError, match="CPU_ATTN"):
        CpuPagedCache([torch.zeros(2, 4, PAGE, HEADS, DIM)], HEADS, DIM)
    with pytest.raises(ConfigurationError, match="contiguous"):
        CpuPagedCache([torch.zeros(BLOCKS, HEADS, 2 * DIM, PAGE).transpose(2, 3)], HEADS, DIM)
    with pytest.raises(ConfigurationError, match="differ"):
        CpuPagedCache([*together(1), torch.zeros(BLOCKS + 1, HEADS, PAGE, 2 * DIM)], HEADS, DIM)
