"""Block Key chain throughput against a bare keyed-template HMAC-SHA-256 loop.

Prints one JSON line. For 16- and 256-token blocks: tokens/s of ``block_keys`` on a token-id
array (the form engines hold prompts in), and its ratio to a bare loop that copies the same
keyed HMAC template and digests the same, pre-built messages (K[i-1] || tokens) in the same run
(target >= 0.85). The rate for a Python list of ints is reported too (its conversion to
uint32 octets is a separate cost, without a target).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hashlib
import hmac

from benchmarks._timing import best_times
from kvsp.core.keys import BLOCK_DOMAIN, block_keys

TARGET = 0.85
TOKENS = 1 << 20


def measure(block_tokens: int) -> dict[str, object]:
    rng = np.random.default_rng(block_tokens)
    scope_key = os.urandom(32)
    compat = os.urandom(32)
    ids = rng.integers(0, 49_152, size=TOKENS, dtype=np.int64)
    as_list = ids.tolist()
    keys = block_keys(scope_key, compat, ids, block_tokens)  # type: ignore[arg-type]
    octets = ids.astype(">u4").tobytes()
    step = 4 * block_tokens
    parents = [bytes(32), *keys[:-1]]
    messages = [p + octets[i * step : (i + 1) * step] for i, p in enumerate(parents)]
    template = hmac.new(scope_key, BLOCK_DOMAIN + compat, hashlib.sha256)

    def bare() -> None:
        copy = template.copy
        for message in messages:
            h = copy()
            h.update(message)
            h.digest()

    times = best_times(
        {
            "bare_hmac": bare,
            "block_keys_array": lambda: block_keys(scope_key, compat, ids, block_tokens),  # type: ignore[arg-type]
            "block_keys_list": lambda: block_keys(scope_key, compat, as_list, block_tokens),  # type: ignore[arg-type]
        },
        repeats=9,
    )
    return {
        "blocks": len(keys),
        "bare_hmac_tokens_per_s": round(TOKENS / times["bare_hmac"]),
        "tokens_per_s": round(TOKENS / times["block_keys_array"]),
        "ratio": round(times["bare_hmac"] / times["block_keys_array"], 3),
        "list_input_tokens_per_s": round(TOKENS / times["block_keys_list"]),
    }


def main() -> None:
    results = {f"block_{b}": measure(b) for b in (16, 256)}
    low = min(float(r["ratio"]) for r in results.values())  # type: ignore[arg-type]
    print(
        json.dumps(
            {
                "benchmark": "block_keys",
                "limit": "bare keyed-template HMAC-SHA-256 .copy() loop over the same messages",
                "target_ratio": TARGET,
                "min_ratio": low,
                "meets_target": low >= TARGET,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
