"""A transformers KV cache whose layers grow in place, for the engine.

transformers' ``DynamicLayer`` concatenates a layer's whole cache with the new tokens' keys and
values on every forward: after a 2,048-token prefix of SmolLM2 that is 94 MB copied into fresh
memory for each token generated, and for the first forward after an imported prefix. A
``GrowingLayer`` keeps its keys and values as the leading tokens of buffers with room for more
and writes only the new tokens. The buffers are ``[batch, kv_heads, capacity, head_dim]``: the
layer's keys are their first tokens, a view attention reads as fast as a contiguous tensor and
with the same output bits (tested; a token-major buffer, as KVB1 sections are laid out, made
decoding's attention a third slower), so an imported prefix is transposed into them once. The
spare room is an eighth of the tokens held (at least 64 tokens): a longer sequence moves to a
larger buffer, so the copies over a generation stay a small multiple of its final size
(decision 0028).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

__all__ = ["GrowingCache", "GrowingLayer", "room_for"]

#: the fewest spare tokens a layer's buffers are made with
MIN_SPARE_TOKENS = 64


def room_for(tokens: int) -> int:
    """The capacity, in tokens, of buffers made to hold ``tokens``."""
    return tokens + max(MIN_SPARE_TOKENS, tokens // 8)


class GrowingLayer(DynamicLayer):
    """One layer's keys and values in head-major buffers with room to grow."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]
        self._rooms: tuple[torch.Tensor, torch.Tensor] | None = None

    def adopt(self, key_room: torch.Tensor, value_room: torch.Tensor, tokens: int) -> None:
        """Hold buffers ``[batch, kv_heads, capacity, head_dim]`` whose first ``tokens``
        tokens are this layer's keys and values (an imported prefix, copied into them)."""
        if key_room.shape != value_room.shape or not 0 <= tokens <= key_room.shape[2]:
            raise ValueError("key and value buffers of one shape, holding the tokens")
        self.dtype, self.device = key_room.dtype, key_room.device
        self.is_initialized = True
        self._rooms = (key_room, value_room)
        self._view(tokens)

    def _view(self, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Make ``keys`` and ``values`` the buffers' first ``tokens`` tokens; answers them."""
        assert self._rooms is not None
        key_room, value_room = self._rooms
        keys = self.keys = key_room[:, :, :tokens]
        values = self.values = value_room[:, :, :tokens]
        return keys, values

    def _holds_views(self) -> bool:
        """Whether ``keys`` is still this layer's view (a caller may have replaced it, as
        ``DynamicLayer``'s beam and batch methods do)."""
        if self._rooms is None or self.keys is None:
            return False
        key_room = self._rooms[0]
        return (
            self.keys.data_ptr() == key_room.data_ptr() and self.keys.stride() == key_room.stride()
        )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens' keys and values (``[batch, kv_heads, tokens, head_dim]``)
        and answer the whole layer's, as ``DynamicLayer.update`` does."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        if not self._holds_views() or end > self._rooms[0].shape[2]:  # type: ignore[index]
            self._move(end, key_states)
        keys, values = self._view(end)
        keys[:, :, start:end] = key_states
        values[:, :, start:end] = value_states
        return keys, values

    def _move(self, tokens: int, like: torch.Tensor) -> None:
        """New buffers with room for ``tokens`` and more, holding what the layer holds."""
        held = self.get_seq_length()
        batch, heads, _, head_dim = like.shape
        shape = (batch, heads, room_for(tokens), head_dim)
        rooms = (
            torch.empty(shape, dtype=like.dtype, device=like.device),
            torch.empty(shape, dtype=like.dtype, device=like.device),
        )
        if held:
            assert self.keys is not None
            assert self.values is not None
            rooms[0][:, :, :held] = self.keys
            rooms[1][:, :, :held] = self.values
        self._rooms = rooms

    def reset(self) -> None:
        self._rooms = None
        super().reset()


class GrowingCache(DynamicCache):
    """A ``DynamicCache`` of ``GrowingLayer``s: made empty (each layer added at its first
    update) or from layers that adopted an imported prefix."""

    def __init__(self, layers: list[GrowingLayer] | None = None) -> None:
        if layers is None:
            Cache.__init__(self, layer_class_to_replicate=GrowingLayer)
        else:
            Cache.__init__(self, layers=list(layers))
