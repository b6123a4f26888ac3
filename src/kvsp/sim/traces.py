"""Mooncake request traces, pure: read them, and turn their 512-token hash ids into the tokens and
KVSP Block Keys a replay needs.

A trace record is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [...]}``; ``hash_ids`` are chained prefix hashes of 512-token blocks (equal ids at
the same position mean a reusable prefix), ``len(hash_ids) == ceil(input_length / 512)``. The
traces carry no text, so each hash id gets 512 pseudo-random token ids seeded by the id: equal
ids give equal tokens, and the Block Keys of a prompt (16-token blocks, keyed with a tenant's
scope key like any real request) are equal exactly where the trace says the prefix is shared.
The last block of a prompt is cut to ``input_length``.

Block Keys are chained, so the keys of a prompt extend the keys of its longest known prefix of
hash ids: ``TraceKeys`` never hashes a block twice.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvsp.core.ids import CompatId, parse_block_key
from kvsp.core.keys import ROOT_PARENT, BlockKeyChain
from kvsp.core.problems import ConfigurationError

__all__ = [
    "TRACE_BLOCK_TOKENS",
    "TraceKeys",
    "TraceRequest",
    "block_reuse",
    "block_tokens",
    "load",
    "tokens_of",
]

#: tokens per trace hash id
TRACE_BLOCK_TOKENS = 512
#: synthetic token ids avoid the lowest ids (special tokens of most vocabularies)
_FIRST_ID, _END_ID = 100, 40_000


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _record(line: str, number: int) -> TraceRequest:
    try:
        doc = json.loads(line)
        request = TraceRequest(
            int(doc["timestamp"]),
            int(doc["input_length"]),
            int(doc["output_length"]),
            tuple(int(h) for h in doc["hash_ids"]),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigurationError(f"trace line {number}: not a trace record ({exc})") from None
    blocks = -(-request.input_length // TRACE_BLOCK_TOKENS)
    if request.input_length < 1 or request.output_length < 0 or len(request.hash_ids) != blocks:
        raise ConfigurationError(
            f"trace line {number}: {request.input_length} input tokens need {blocks} hash ids, "
            f"not {len(request.hash_ids)}"
        )
    return request


def load(path: Path | str) -> list[TraceRequest]:
    """Every record of a JSON-lines trace, in file order (``ConfigurationError`` names the first
    bad line)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigurationError(f"cannot read trace {path}: {exc.strerror}") from None
    return [_record(line, n) for n, line in enumerate(lines, 1) if line.strip()]


def block_reuse(requests: Iterable[TraceRequest]) -> float:
    """The share of block references whose prefix was seen earlier (infinite cache, in order):
    the upper bound of prefix reuse for the trace."""
    seen: set[tuple[int, ...]] = set()
    total = reused = 0
    for request in requests:
        for i in range(len(request.hash_ids)):
            prefix = request.hash_ids[: i + 1]
            total += 1
            if prefix in seen:
                reused += 1
            else:
                seen.add(prefix)
    return reused / total if total else 0.0


_MIX_1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX_2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_POSITIONS = np.arange(TRACE_BLOCK_TOKENS, dtype=np.uint64)


def block_tokens(hash_ids: Sequence[int]) -> npt.NDArray[np.uint32]:
    """512 pseudo-random token ids per hash id, back to back: a SplitMix64 finaliser over
    (hash id, position), vectorised, because a replay synthesises millions of blocks."""
    ids = np.asarray(hash_ids, dtype=np.uint64)
    x = ((ids[:, None] << np.uint64(9)) | _POSITIONS).ravel() * _GOLDEN
    x ^= x >> np.uint64(30)
    x *= _MIX_1
    x ^= x >> np.uint64(27)
    x *= _MIX_2
    x ^= x >> np.uint64(31)
    return (x % np.uint64(_END_ID - _FIRST_ID) + np.uint64(_FIRST_ID)).astype(np.uint32)


def tokens_of(request: TraceRequest) -> list[int]:
    """The prompt's synthetic token ids (``input_length`` of them)."""
    ids: list[int] = block_tokens(request.hash_ids)[: request.input_length].tolist()
    return ids


class TraceKeys:
    """Block Keys of trace prompts under one scope key and Compatibility ID.

    Hash ids are chained (an id determines its whole prefix, as in the Mooncake traces and the
    generators of ``sim.workload``), so the keys up to a whole trace block are remembered by
    that block's id: one list per prompt, shared by the ids of its blocks, never a copy per
    prefix."""

    def __init__(self, scope_key: bytes, compat_id: CompatId, block_tokens: int = 16) -> None:
        if TRACE_BLOCK_TOKENS % block_tokens:
            raise ConfigurationError(f"block_tokens must divide {TRACE_BLOCK_TOKENS}")
        self.scope_key = scope_key
        self.compat_id = compat_id
        self.block_tokens = block_tokens
        #: hash id of a whole trace block -> (the key list it ends in, its end in that list)
        self._ends: dict[int, tuple[list[str], int]] = {}

    def keys(self, request: TraceRequest) -> list[str]:
        """The hex Block Keys of the prompt's whole blocks."""
        ids = request.hash_ids
        known = len(ids)
        while known and ids[known - 1] not in self._ends:
            known -= 1
        keys: list[str] = []
        if known:
            shared, end = self._ends[ids[known - 1]]
            keys = shared[:end]
        if known == len(ids):
            return keys
        tokens = block_tokens(ids[known:])[: request.input_length - known * TRACE_BLOCK_TOKENS]
        keys += [k.hex() for k in self._chain(keys).extend(tokens)]
        per_block = TRACE_BLOCK_TOKENS // self.block_tokens
        whole = request.input_length // TRACE_BLOCK_TOKENS  # a cut last block is never shared
        for i in range(known, whole):
            self._ends[ids[i]] = (keys, (i + 1) * per_block)
        return keys

    def _chain(self, keys: list[str]) -> BlockKeyChain:
        parent = parse_block_key(keys[-1]) if keys else ROOT_PARENT
        return BlockKeyChain(self.scope_key, self.compat_id, self.block_tokens, parent)
