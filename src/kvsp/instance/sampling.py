"""Choosing the next token from logits, reproducibly: greedy, temperature, top-k, top-p.

The random draw at output step n is ``u = SHA-256("KVSP-SAMPLE-1" || 0x00 || seed || n)`` read
as a number in [0, 1): it depends only on (seed, n), never on what ran before, so an instance
that resumes a session at step n (KVSP 6.8) draws exactly what the failed one would have. The
choice walks the candidates in a fixed order (probability descending, then token id) and takes
the first whose cumulative probability exceeds u; probabilities are computed in float64.
Greedy takes the highest logit, the lowest token id on ties.
"""

from __future__ import annotations

import hashlib

import numpy as np
import numpy.typing as npt

from kvsp.core.records import Sampler

__all__ = ["draw", "next_token"]

_DOMAIN = b"KVSP-SAMPLE-1\x00"


def draw(seed: int, step: int) -> float:
    """The uniform number in [0, 1) that step ``step`` of a ``seed`` sampler uses."""
    digest = hashlib.sha256(_DOMAIN + seed.to_bytes(8, "big") + step.to_bytes(8, "big")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def next_token(logits: npt.NDArray[np.floating], sampler: Sampler, step: int) -> int:
    """The token chosen at output step ``step`` (0 for the first generated token)."""
    values = np.asarray(logits, dtype=np.float64).reshape(-1)
    if sampler.method == "greedy":
        return int(np.argmax(values))  # first maximum: the lowest id on ties
    params = sampler.params
    scaled = values / float(params.get("temperature", 1.0))
    order = np.lexsort((np.arange(len(scaled)), -scaled))  # logit descending, then id
    if sampler.method == "top-k":
        order = order[: int(params["k"])]
    chosen = scaled[order]
    probs = np.exp(chosen - chosen[0])
    probs /= probs.sum()
    if sampler.method == "top-p":
        cumulative = np.cumsum(probs)
        keep = int(np.searchsorted(cumulative, float(params["p"]), side="left")) + 1
        probs = probs[:keep] / probs[:keep].sum()
        order = order[:keep]
    u = draw(sampler.seed, step)
    index = int(np.searchsorted(np.cumsum(probs), u, side="right"))
    return int(order[min(index, len(order) - 1)])
