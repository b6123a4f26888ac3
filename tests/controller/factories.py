"""Checkpoints and shard maps for controller tests."""

from __future__ import annotations

from typing import Any

from kvsp.core.records import SessionCheckpoint, ShardMap
from tests.index.factories import COMPAT, SCOPE_A, key

SESSION = "6f1d0a9e-2c55-4d7e-9a0e-5b7f2f9f6a11"


def checkpoint(generated: int = 0, epoch: int = 0, **changes: Any) -> SessionCheckpoint:
    doc: dict[str, Any] = {
        "session": SESSION,
        "epoch": epoch,
        "compat_id": COMPAT,
        "scope_id": SCOPE_A,
        "prompt_blocks": [key(0), key(1)],
        "prompt_tail": [374, 264],
        "generated": list(range(100, 100 + generated)),
        "output_offset": generated,
        "sampler": {"method": "top-p", "params": {"p": 0.9}, "seed": 7, "step": generated},
    }
    doc.update(changes)
    return SessionCheckpoint.parse(doc)


def shard_map(version: int, *shards: tuple[int, int, str], name: str = "m1") -> ShardMap:
    return ShardMap.parse(
        {
            "map": name,
            "version": version,
            "shards": [{"tokens": [a, b], "instance": i} for a, b, i in shards],
        }
    )
