"""vLLM's CPU paged KV cache and kvsp-layout-1, converted both ways without a detour.

vLLM's CPU attention backend (``CPU_ATTN``, KV cache layout LBHNC) keeps one tensor per layer
shaped ``[num_blocks, kv_heads, block_size, 2 * head_dim]``. Inside each (block, head) the first
``block_size * head_dim`` elements hold K transposed (``[head_dim, block_size]``) and the rest
hold V as ``[block_size, head_dim]`` (measured against the transformers engine's KV for the same
tokens). kvsp-layout-1 sections are ``[tokens, kv_heads, head_dim]``. A KVSP block may start
anywhere inside a vLLM block (its token offset), so both directions take a vLLM block id and an
offset; the copies are numpy assignments through strided views of the engine's own memory.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvsp.core.problems import ConfigurationError

__all__ = ["CpuPagedLayer"]

Array = npt.NDArray[np.generic]


class CpuPagedLayer:
    """One layer of vLLM's CPU KV cache, seen as K ``[blocks, heads, head_dim, block_size]``
    and V ``[blocks, heads, block_size, head_dim]`` views of the same memory."""

    def __init__(self, cache: Array, kv_heads: int, head_dim: int) -> None:
        if cache.ndim != 4 or cache.shape[1] != kv_heads or cache.shape[3] != 2 * head_dim:
            raise ConfigurationError(
                f"vLLM KV cache shaped {cache.shape}, expected "
                f"[blocks, {kv_heads}, block_size, {2 * head_dim}] (CPU_ATTN layout)"
            )
        if not cache.flags.c_contiguous:
            raise ConfigurationError("vLLM KV cache layer is not contiguous")
        blocks, heads, block_size, _ = cache.shape
        self.block_size = block_size
        flat = cache.reshape(blocks, heads, 2 * block_size * head_dim)
        half = block_size * head_dim
        self.k = flat[:, :, :half].reshape(blocks, heads, head_dim, block_size)
        self.v = flat[:, :, half:].reshape(blocks, heads, block_size, head_dim)

    def _span(self, offset: int, tokens: int) -> slice:
        if not 0 <= offset < offset + tokens <= self.block_size:
            raise ValueError(f"tokens {offset}..{offset + tokens} outside a vLLM block")
        return slice(offset, offset + tokens)

    def write(self, block: int, offset: int, k: Array, v: Array) -> None:
        """Put ``[tokens, heads, head_dim]`` sections at token ``offset`` of vLLM ``block``."""
        span = self._span(offset, k.shape[0])
        # copyto on views: half the time of slice assignment for these small strided copies
        np.copyto(self.k[block, :, :, span], k.transpose(1, 2, 0))
        np.copyto(self.v[block, :, span, :], v.transpose(1, 0, 2))

    def read(self, block: int, offset: int, tokens: int) -> tuple[Array, Array]:
        """Fresh ``[tokens, heads, head_dim]`` copies of K and V at ``offset`` of ``block``."""
        span = self._span(offset, tokens)
        k = np.ascontiguousarray(self.k[block, :, :, span].transpose(2, 0, 1))
        v = np.ascontiguousarray(self.v[block, :, span, :].transpose(1, 0, 2))
        return k, v
