"""NVIDIA Dynamo's KV router index (``dynamo._core.RadixTree``, ai-dynamo-runtime 1.6.1) as a
peer for in-process lookups and ingest, run under build/peers/dynamo's interpreter; also the
local block hashes its standalone indexer's ``query_by_hash`` takes.

Block ``n`` is local hash ``n + 1`` and sequence hash ``n + 1``; blocks are stored as chains of
``chain`` blocks, each chain one ``stored`` event of one worker, as a vLLM worker's publisher
sends them. A lookup is ``find_matches`` of a prompt's local hashes, the call Dynamo's router
makes per request."""

from __future__ import annotations

import gc
import json
import os
import time
from typing import Any

from _driver import serve
from dynamo._core import RadixTree, compute_block_hash_for_seq


def resident_octets() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def stored_event(event_id: int, first: int, chain: int) -> bytes:
    blocks = [{"block_hash": n + 1, "tokens_hash": n + 1} for n in range(first, first + chain)]
    data = {"stored": {"parent_hash": None, "blocks": blocks}}
    return json.dumps({"event_id": event_id, "data": data}).encode()


class Peer:
    def __init__(self) -> None:
        self.tree: RadixTree | None = None
        self.prompts: list[list[int]] = []

    def load(self, blocks: int, chain: int) -> dict[str, Any]:
        """Store ``blocks`` blocks; answers the blocks per second applied (the events made
        beforehand, so only ``apply_event`` is timed) and the resident octets per block."""
        events = [stored_event(e, first, chain) for e, first in enumerate(range(0, blocks, chain))]
        gc.collect()
        before = resident_octets()
        self.tree = RadixTree()
        start = time.perf_counter()
        for event in events:
            self.tree.apply_event(1, event)
        self.tree.find_matches([1])  # every event before it has been applied
        seconds = time.perf_counter() - start
        del events
        gc.collect()
        return {
            "blocks_per_s": blocks / seconds,
            "octets_per_block": (resident_octets() - before) / blocks,
        }

    def matches(self, prompt: list[int]) -> dict[str, Any]:
        assert self.tree is not None
        scores = self.tree.find_matches(prompt).scores
        return {"matched": {f"{w}:{r}": n for (w, r), n in scores.items()}}

    def rate(self, prompts: list[list[int]], seconds: float) -> dict[str, Any]:
        assert self.tree is not None
        find, done, start = self.tree.find_matches, 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            for prompt in prompts:
                find(prompt)
            done += len(prompts)
        return {"lookups_per_s": done / (time.perf_counter() - start)}

    def local_hashes(self, prompts: list[list[int]], block_tokens: int) -> dict[str, Any]:
        """Each prompt's local block hashes, as Dynamo's router computes them from the tokens
        (what its indexer's ``query_by_hash`` takes)."""
        return {"hashes": [compute_block_hash_for_seq(p, block_tokens) for p in prompts]}

    def close(self) -> dict[str, Any]:
        self.tree = None
        return {}


if __name__ == "__main__":
    peer = Peer()
    serve({
        "load": peer.load, "matches": peer.matches, "rate": peer.rate,
        "local_hashes": peer.local_hashes, "close": peer.close,
    })  # fmt: skip
