"""Grouped-query attention for the engine without copies of the key and value heads.

SmolLM2 has 9 query heads and 3 key/value heads. transformers' ``sdpa`` attention hands torch
the grouping (``enable_gqa``) only when there is no mask; with one (a prompt's last tokens
after an imported prefix: 16 query rows against 2,048 cached ones) it first repeats every
key/value head for each query head of its group, copying the whole cache three times per
layer per forward. torch's CPU kernel takes the grouping with a mask too, with the same output
bits (tested), so this attention always hands it over: on a 2,048-token prefix the 16-token
forward lost its 33-41 ms of copies and its attention took half as long (decision 0027).

Anything outside the plain causal case (a position bias, a paged cache, the prefill of a static
cache's empty slots) goes to transformers' own ``sdpa`` unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

__all__ = ["GROUPED_SDPA", "grouped_sdpa"]

#: the ``attn_implementation`` the engine loads its model with
GROUPED_SDPA = "kvsp_grouped_sdpa"


def grouped_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: [batch, heads, tokens, head_dim] in, the
    output as [batch, tokens, heads, head_dim]."""
    q_length = query.shape[2]
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    causal = causal and attention_mask is None and q_length > 1
    special = kwargs.get("position_bias") is not None or kwargs.get("cache") is not None
    if special or (causal and key.shape[2] > q_length):  # the last: a static cache's prefill
        out: tuple[torch.Tensor, None] = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs
        )
        return out
    attended = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return attended.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)
