"""vLLM's CPU paged KV cache and kvsp-layout-1, converted both ways without a detour.

vLLM's CPU attention backend (``CPU_ATTN``, KV cache layout LBHNC) keeps one tensor per layer
shaped ``[num_blocks, kv_heads, block_size, 2 * head_dim]``. Inside each (block, head) the first
``block_size * head_dim`` elements hold K transposed (``[head_dim, block_size]``) and the rest
hold V as ``[block_size, head_dim]`` (measured against the transformers engine's KV for the same
tokens). kvsp-layout-1 sections are ``[tokens, kv_heads, head_dim]``, K then V per layer, the
layers of a container one after the other. A KVSP block may start anywhere inside a vLLM block
(its token offset), so both directions take a vLLM block id and an offset.

vLLM allocates the layers' tensors in one piece, one after the other; such layers are seen
through one view with a layer axis, so writing a run of layers of a block is one strided copy
for K and one for V. Layers allocated apart get a view each. The copies are numpy's, on the
calling thread: torch's would run on vLLM's OpenMP threads, which then spin beside the
connector's receiving thread (measured: slower).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvsp.core.problems import ConfigurationError

__all__ = ["CpuPagedCache"]

Array = npt.NDArray[np.generic]


@dataclass(frozen=True)
class _Span:
    """Layers ``first..first+count-1``, which lie one after the other in memory: K as
    ``[layers, blocks, heads, head_dim, block_size]`` and V as
    ``[layers, blocks, heads, block_size, head_dim]`` views of the engine's memory."""

    first: int
    count: int
    k: Array
    v: Array


def _spans(layers: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """(first, count) of each run of layers that follow each other in one storage."""
    out: list[tuple[int, int]] = []
    for i, cache in enumerate(layers):
        if out:
            first, count = out[-1]
            head = layers[first]
            if (
                cache.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()
                and cache.storage_offset() == head.storage_offset() + count * head.numel()
            ):
                out[-1] = (first, count + 1)
                continue
        out.append((i, 1))
    return out


class CpuPagedCache:
    """Every layer of vLLM's CPU KV cache, written from and read into kvsp-layout-1."""

    def __init__(self, layers: Sequence[torch.Tensor], kv_heads: int, head_dim: int) -> None:
        if not layers:
            raise ConfigurationError("vLLM registered no KV cache layers")
        shape = layers[0].shape
        for cache in layers:
            if cache.dim() != 4 or cache.shape[1] != kv_heads or cache.shape[3] != 2 * head_dim:
                raise ConfigurationError(
                    f"vLLM KV cache shaped {tuple(cache.shape)}, expected "
                    f"[blocks, {kv_heads}, block_size, {2 * head_dim}] (CPU_ATTN layout)"
                )
            if cache.shape != shape or cache.dtype != layers[0].dtype:
                raise ConfigurationError("vLLM KV cache layers differ in shape or dtype")
            if not cache.is_contiguous():
                raise ConfigurationError("vLLM KV cache layer is not contiguous")
        blocks, heads, block_size, _ = shape
        self.block_size = block_size
        self.layers = len(layers)
        self.dtype = layers[0].numpy().dtype
        self._kv_heads, self._head_dim = kv_heads, head_dim
        half = block_size * head_dim
        self._spans = []
        for first, count in _spans(layers):
            head = layers[first]
            size = (count, *head.shape)
            stride = (head.numel(), *head.stride())
            joined = torch.as_strided(head, size, stride, head.storage_offset()).numpy()
            flat = joined.reshape(count, blocks, heads, 2 * half)
            k = flat[..., :half].reshape(count, blocks, heads, head_dim, block_size)
            v = flat[..., half:].reshape(count, blocks, heads, block_size, head_dim)
            self._spans.append(_Span(first, count, k, v))

    @property
    def views(self) -> int:
        """How many views the layers are seen through (1 when vLLM allocated them together)."""
        return len(self._spans)

    def _tokens(self, offset: int, tokens: int) -> slice:
        if not 0 <= offset < offset + tokens <= self.block_size:
            raise ValueError(f"tokens {offset}..{offset + tokens} outside a vLLM block")
        return slice(offset, offset + tokens)

    def write(
        self, first_layer: int, block: int, offset: int, tokens: int, sections: memoryview
    ) -> None:
        """Put the K and V sections of consecutive layers from ``first_layer`` on (``sections``:
        the layers' octets as they lie in a container, each ``[tokens, heads, head_dim]``) at
        token ``offset`` of vLLM ``block``."""
        span = self._tokens(offset, tokens)
        source = np.frombuffer(sections, dtype=self.dtype)
        source = source.reshape(-1, 2, tokens, self._kv_heads, self._head_dim)
        last = first_layer + source.shape[0]
        if not 0 <= first_layer < last <= self.layers:
            raise ValueError(f"layers {first_layer}..{last - 1} outside the cache")
        for s in self._spans:
            lo, hi = max(first_layer, s.first), min(last, s.first + s.count)
            if lo >= hi:
                continue
            part = source[lo - first_layer : hi - first_layer]
            into = slice(lo - s.first, hi - s.first)
            np.copyto(s.k[into, block, :, :, span], part[:, 0].transpose(0, 2, 3, 1))
            np.copyto(s.v[into, block, :, span, :], part[:, 1].transpose(0, 2, 1, 3))

    def read(self, layer: int, block: int, offset: int, tokens: int) -> tuple[Array, Array]:
        """Fresh ``[tokens, heads, head_dim]`` copies of K and V of ``layer`` at ``offset`` of
        ``block``."""
        span = self._tokens(offset, tokens)
        s = next(s for s in self._spans if s.first <= layer < s.first + s.count)
        i = layer - s.first
        k = np.ascontiguousarray(s.k[i, block, :, :, span].transpose(2, 0, 1))
        v = np.ascontiguousarray(s.v[i, block, :, span, :].transpose(1, 0, 2))
        return k, v
