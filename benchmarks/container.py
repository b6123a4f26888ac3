"""KVB1 container throughput against hashlib.sha256 over the same octets.

Prints one JSON line. For each block shape: encode+digest (``Container.build`` from arrays,
which copies each section once and computes every layer digest) and decode+verify
(``Container.parse`` + ``verify`` against the layer digests and the replica digest), each as
GB/s and as a ratio to one ``hashlib.sha256`` pass over the container (target >= 0.85); and
layer-range slicing without verification, which must not copy (GB/s equivalent of the sliced
octets, plus a check that the slice views the source buffer).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._timing import best_times
from kvsp.core.compat import Geometry
from kvsp.core.container import Container
from kvsp.core.registries import ELEMENT_TYPES

TARGET = 0.85
SHAPES = {
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x 16 tokens, float32 (720 KiB)
    "smollm2_block": (30, 3, 64, 16),
    # a 2 MiB block: 32 layers x 8 KV heads x 64 dims x 16 tokens, float32
    "2mib_block": (32, 8, 64, 16),
}


def measure(layers: int, kv_heads: int, head_dim: int, tokens: int) -> dict[str, object]:
    geometry = Geometry(layers, kv_heads, head_dim, ELEMENT_TYPES["float32"])
    rng = np.random.default_rng(0)
    shape = (tokens, kv_heads, head_dim)
    sections = [
        (rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32))
        for _ in range(layers)
    ]
    built = Container.build(0, tokens, sections, geometry=geometry)
    data = built.tobytes()
    digests = list(built.layer_digests())
    replica = built.digest()
    first, last = layers // 4, layers - layers // 4 - 1

    def decode_verify() -> None:
        Container.parse(data, geometry).verify(digests, replica)

    def slice_only() -> None:
        Container.parse(data, geometry).slice(first, last)

    repeats = 60 if len(data) < 1 << 20 else 30
    times = best_times(
        {
            "sha256": lambda: hashlib.sha256(data).digest(),
            "encode_digest": lambda: Container.build(0, tokens, sections, geometry=geometry),
            "decode_verify": decode_verify,
            "slice": slice_only,
        },
        repeats,
    )
    part = Container.parse(data, geometry).slice(first, last)
    gbps = {name: len(data) / t / 1e9 for name, t in times.items()}
    return {
        "octets": len(data),
        "sha256_gb_per_s": round(gbps["sha256"], 3),
        "encode_digest_gb_per_s": round(gbps["encode_digest"], 3),
        "encode_digest_ratio": round(times["sha256"] / times["encode_digest"], 3),
        "decode_verify_gb_per_s": round(gbps["decode_verify"], 3),
        "decode_verify_ratio": round(times["sha256"] / times["decode_verify"], 3),
        "slice_layers": [first, last],
        "slice_gb_per_s_equivalent": round(part.header.data_octets / times["slice"] / 1e9, 1),
        "slice_copies_data": part.parts[1].obj is not data,  # type: ignore[union-attr]
    }


def main() -> None:
    results = {name: measure(*shape) for name, shape in SHAPES.items()}
    ratios = [
        r[k] for r in results.values() for k in ("encode_digest_ratio", "decode_verify_ratio")
    ]
    print(
        json.dumps(
            {
                "benchmark": "container",
                "limit": "hashlib.sha256 over the same octets, same run",
                "target_ratio": TARGET,
                "min_ratio": min(ratios),  # type: ignore[type-var]
                "meets_target": min(ratios) >= TARGET  # type: ignore[operator]
                and not any(r["slice_copies_data"] for r in results.values()),
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
