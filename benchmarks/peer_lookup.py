"""Index lookups and ingest in process, kvsp's Index Service against NVIDIA Dynamo's KV router
index (``RadixTree``), on the same blocks and the same prompts in the same run. Prints one JSON
line.

Both hold 1,000,000 blocks, stored as chains of 64 (Dynamo: one ``stored`` event per chain;
kvsp: one ``POST replicas`` body of 64 whole-block replica records, as a holder publishes a
prompt's blocks).
A prompt is 64 blocks: all of one chain (``full`` hit), or its first 32 and 32 blocks nobody
holds (``half``). kvsp answers with every matched block's replica records (holder, residency,
digest, TTL); Dynamo with matched blocks per worker. Rounds of the two are interleaved, on an
idle machine and on a busy one (a process spinning on one of the cores all along); each figure
is the median over rounds and each ratio (kvsp / Dynamo) the median of the rounds' ratios.
Also printed: ingest (blocks per second applied) and resident memory per block: whole-block
records at the 1,000,000 Dynamo holds (at 100,000 the loader's transient objects, freed but
interleaved with the stored ones in the allocator's pools, add about 11 MB, a third more per
record; decision 0026), records with 30 layer digests at 100,000 (their cost is the records'
own, the same at any count), each load in a process of its own.

Targets: lookups >= 1.0 of Dynamo's, full and half hits, idle and busy; memory <= 256 octets
per whole-block record and <= 1,300 with 30 layer digests; ingest >= 1.0 of Dynamo's.

Needs ``make peer-deps`` (``make bench-peers`` runs it).
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._peers import PeerDriver, interleaved, report, versus
from benchmarks.index_lookup import (
    COMPAT,
    DEV,
    LIMITS,
    MEMORY_LIMIT,
    MEMORY_LIMIT_DIGESTS,
    SCOPE,
    block_key,
    load_memory,
    records,
    template,
)
from kvsp.core.clock import SystemClock
from kvsp.core.records import LookupRequest
from kvsp.index.client import batch_body
from kvsp.index.service import IndexService
from kvsp.index.stores import MemoryReplicaStore
from kvsp.web.serving import tune_collector

BLOCKS = 1_000_000
CHAIN = 64
PROMPTS = 500
ROUNDS = 5
ROUND_SECONDS = 1.5


def prompt_blocks(hit: str) -> list[list[int]]:
    """Block numbers of each prompt; blocks from ``BLOCKS`` on are held by nobody."""
    rng, unknown, out = random.Random(11), BLOCKS, []
    for _ in range(PROMPTS):
        first = rng.randrange(BLOCKS // CHAIN) * CHAIN
        if hit == "full":
            out.append(list(range(first, first + CHAIN)))
        else:
            out.append([*range(first, first + CHAIN // 2), *range(unknown, unknown + CHAIN // 2)])
            unknown += CHAIN // 2
    return out


def kvsp_ingest(service: IndexService) -> float:
    """Blocks per second published into ``service``: a prompt's 64 records a ``POST
    replicas`` body, as a holder sends it, handed to the service as its route does (JSON in,
    as Dynamo's ``apply_event`` takes its events). The bodies are written beforehand, as
    Dynamo's events are, so only the publishes are timed."""
    base = template(layer_digests=False)
    bodies = [
        batch_body(
            [
                r.model_dump_json(exclude_none=True).encode()
                for r in records(first, first + CHAIN, base)
            ]
        )
        for first in range(0, BLOCKS, CHAIN)
    ]

    async def publish_all() -> float:
        start = time.perf_counter()
        for body in bodies:
            await service.batch_body(DEV, body)
        return BLOCKS / (time.perf_counter() - start)

    return asyncio.run(publish_all())


def matched_blocks(answer: bytes) -> int:
    return sum(1 for replicas in json.loads(answer)["replicas"] if replicas)


async def lookup_rounds(service: IndexService, dynamo: PeerDriver) -> dict[str, Any]:
    return {hit: await hit_rounds(service, dynamo, prompt_blocks(hit)) for hit in ("full", "half")}


async def hit_rounds(
    service: IndexService, dynamo: PeerDriver, blocks: list[list[int]]
) -> dict[str, Any]:
    """kvsp's and Dynamo's lookups of the same prompts, in interleaved rounds."""
    requests = [
        LookupRequest(scope_id=SCOPE, compat_id=COMPAT, block_keys=tuple(block_key(n) for n in p))
        for p in blocks
    ]
    hashes = [[n + 1 for n in p] for p in blocks]
    ours = matched_blocks(await service.lookup(DEV, requests[0]))
    theirs = dynamo.call("matches", prompt=hashes[0])["matched"]
    if [ours] != list(theirs.values()):
        raise RuntimeError(f"kvsp matched {ours} blocks of a prompt, Dynamo {theirs}")

    async def kvsp_rate() -> float:
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < ROUND_SECONDS:
            for request in requests:
                await service.lookup(DEV, request)
            done += len(requests)
        return done / (time.perf_counter() - start)

    async def dynamo_rate() -> float:
        return float(dynamo.call("rate", prompts=hashes, seconds=ROUND_SECONDS)["lookups_per_s"])

    figures = await interleaved({"kvsp": kvsp_rate, "dynamo": dynamo_rate}, ROUNDS)
    names = ("kvsp_lookups_per_s", "dynamo_lookups_per_s")
    return {"matched_blocks": ours, **versus(figures["kvsp"], figures["dynamo"], names)}


def memory_per_record(count: int, layer_digests: bool) -> float:
    """Resident octets per record of ``count`` records loaded into a store, measured in a
    process of its own: in this one, the freed memory of a load slowed the ingest measured
    after it by a third (its allocations scattered over the freed pools), and an ingest's
    freed bodies would make a later load look smaller."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from benchmarks import peer_lookup as p; "
        "print(p.memory_here(int(sys.argv[2]), sys.argv[3] == 'digests'))"
    )
    root = str(Path(__file__).resolve().parent.parent)
    kind = "digests" if layer_digests else "plain"
    done = subprocess.run(
        [sys.executable, "-c", code, root, str(count), kind],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(done.stdout)


def memory_here(count: int, layer_digests: bool) -> float:
    tune_collector()  # as every kvsp service runs
    return load_memory(MemoryReplicaStore(SystemClock(), LIMITS), count, template(layer_digests))


def main() -> None:
    per_record_digests = memory_per_record(100_000, layer_digests=True)
    per_record = memory_per_record(BLOCKS, layer_digests=False)
    tune_collector()  # as every kvsp service runs
    service = IndexService(MemoryReplicaStore(SystemClock(), LIMITS))
    ingest = kvsp_ingest(service)
    with PeerDriver("dynamo", "dynamo_radix") as dynamo:
        loaded = dynamo.call("load", blocks=BLOCKS, chain=CHAIN)
        idle = asyncio.run(lookup_rounds(service, dynamo))
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            busy = asyncio.run(lookup_rounds(service, dynamo))
        finally:
            hog.kill()
            hog.wait()
    lookups = {
        f"{hit}_hit_{machine}": figures[hit]
        for machine, figures in (("idle", idle), ("busy", busy))
        for hit in figures
    }
    results = {
        "blocks": BLOCKS,
        "prompt_blocks": CHAIN,
        **lookups,
        "ingest": {
            "kvsp_blocks_per_s": round(ingest),
            "dynamo_blocks_per_s": round(loaded["blocks_per_s"]),
            "ratio": round(ingest / loaded["blocks_per_s"], 3),
        },
        "memory": {
            "kvsp_octets_per_whole_block_record": round(per_record),
            "kvsp_octets_per_record_with_30_layer_digests": round(per_record_digests),
            "dynamo_octets_per_block": round(loaded["octets_per_block"]),
            "ratio_to_limit": round(per_record / MEMORY_LIMIT, 3),
            "ratio_to_limit_with_30_layer_digests": round(
                per_record_digests / MEMORY_LIMIT_DIGESTS, 3
            ),
        },
    }
    meets = (
        all(case["ratio"] >= 1.0 for case in lookups.values())
        and results["ingest"]["ratio"] >= 1.0
        and per_record <= MEMORY_LIMIT
        and per_record_digests <= MEMORY_LIMIT_DIGESTS
    )
    peer = "ai-dynamo-runtime 1.6.1 RadixTree, in process (find_matches, apply_event)"
    report("peer_lookup", {"dynamo": peer}, meets, results)


if __name__ == "__main__":
    main()
