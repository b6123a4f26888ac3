"""The cyclic collector's cost on an Index Service holding 1,000,000 records. Prints one JSON line.

The memory store takes its records out of the collector (``kvsp.index.keytable.untrack``,
decision 0025). Measured in the same run, each in a process of its own with the collector tuned
as ``kvsp index serve`` tunes it: the same records stored with and without that step. Figures:
the pause of one full collection with every record held (a lookup that arrives meanwhile
waits; target: at most 1/10 of the tracked store's, and below 50 ms), the objects the collector
tracks per record, and the store's cost per record (young collections walk fewer objects).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.index_lookup import LIMITS, records, template
from kvsp.core.clock import SystemClock
from kvsp.index import keytable, replicas
from kvsp.index.stores import MemoryReplicaStore
from kvsp.web.serving import tune_collector

BATCH = 10_000


def measure(count: int, untracked: bool) -> dict[str, float]:
    """Store ``count`` records, then time a full collection (in this process)."""
    if not untracked:
        replicas.untrack = lambda *objects: None  # type: ignore[assignment]
    tune_collector()
    store = MemoryReplicaStore(SystemClock(), LIMITS)
    base = template(layer_digests=False)
    stored = 0.0
    for start in range(0, count, BATCH):
        batch = records(start, min(start + BATCH, count), base)
        began = time.perf_counter()
        store.table.publish_many(batch)
        stored += time.perf_counter() - began
    del batch
    gc.collect()
    tracked = len(gc.get_objects())
    pauses = []
    for _ in range(3):
        began = time.perf_counter()
        gc.collect()
        pauses.append(time.perf_counter() - began)
    return {
        "full_collection_s": min(pauses),
        "tracked_objects_per_record": tracked / count,
        "store_us_per_record": stored / count * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--one", choices=["untracked", "tracked"])
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.records, args.one == "untracked")))
        return
    figures = {}
    for mode in ("untracked", "tracked", "untracked", "tracked"):  # interleaved, best of two
        line = subprocess.run(
            [sys.executable, __file__, "--records", str(args.records), "--one", mode],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        got = json.loads(line)
        kept = figures.setdefault(mode, got)
        for name, value in got.items():
            kept[name] = min(kept[name], value)
    kvsp, tracked = figures["untracked"], figures["tracked"]
    ratio = kvsp["full_collection_s"] / tracked["full_collection_s"]
    print(
        json.dumps(
            {
                "benchmark": "index_collector",
                "records": args.records,
                "compiled": keytable.COMPILED,
                "full_collection_ms": round(kvsp["full_collection_s"] * 1e3, 1),
                "full_collection_ms_records_tracked": round(tracked["full_collection_s"] * 1e3, 1),
                "ratio": round(ratio, 3),
                "target_ratio": 0.1,
                "target_ms": 50,
                "tracked_objects_per_record": round(kvsp["tracked_objects_per_record"], 3),
                "tracked_objects_per_record_records_tracked": round(
                    tracked["tracked_objects_per_record"], 3
                ),
                "store_us_per_record": round(kvsp["store_us_per_record"], 2),
                "store_us_per_record_records_tracked": round(tracked["store_us_per_record"], 2),
                "pass": ratio <= 0.1 and kvsp["full_collection_s"] <= 0.05,
            }
        )
    )


if __name__ == "__main__":
    main()
