"""Placement decisions per second for 64 instances and 64-block prompts. Prints one JSON line.

- ``pure``: the controller's steps in process: Block Keys of a 1,024-token prompt (the tenant's
  scope key), the Index Service lookup with all 64 instances as targets (``IndexService`` on the
  memory store, estimates included), and scoring every instance (``place``); the share of time
  in each step is reported.
- ``http``: ``ControllerService.place`` with the Index Service in its own process over HTTP, as a
  ratio to the same lookups sent straight to that IS (the floor of any placement that asks the
  IS; target none: reported so the controller's own cost is visible).

Every instance has links to 4 holders; every block has 2 replicas on those holders.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.servers import Service

from kvsp.auth import DEVELOPMENT
from kvsp.controller.placement import PlacementPolicy, PlacementRequest, place
from kvsp.controller.service import ControllerConfig, ControllerService
from kvsp.core.clock import SystemClock
from kvsp.core.ids import parse_compat_id
from kvsp.core.keys import BlockKeyChain, scope_id
from kvsp.core.records import InstanceStatusRecord, LookupRequest, LookupResponse, ReplicaRecord
from kvsp.index.client import IndexClient
from kvsp.index.rules import IndexLimits
from kvsp.index.service import IndexService
from kvsp.index.stores import MemoryReplicaStore
from kvsp.tenants import Tenants

INSTANCES = 64
BLOCKS = 64
BLOCK_TOKENS = 16
HOLDERS = [f"http://127.0.0.1:{9500 + n}/kvsp/" for n in range(4)]
COMPAT = "c0" * 32
SCOPE_KEY = bytes.fromhex("33" * 32)
SCOPE = scope_id(SCOPE_KEY).hex()
SECONDS = 3.0
TENANTS = Tenants.parse(
    f'[tenants.bench]\nscope_key = "{SCOPE_KEY.hex()}"\ncompat_ids = ["{COMPAT}"]\n'
)


def prompt(n: int) -> list[int]:
    return [(n * 7919 + i) % 50_000 for i in range(BLOCKS * BLOCK_TOKENS)]


def keys_of(tokens: list[int]) -> tuple[str, ...]:
    chain = BlockKeyChain(SCOPE_KEY, parse_compat_id(COMPAT), BLOCK_TOKENS)
    return tuple(k.hex() for k in chain.extend(tokens))


def records(keys: tuple[str, ...]) -> list[ReplicaRecord]:
    out = []
    for i, key in enumerate(keys):
        for holder in (HOLDERS[i % 4], HOLDERS[(i + 1) % 4]):
            out.append(
                ReplicaRecord.parse(
                    {
                        "block_key": key, "compat_id": COMPAT, "scope_id": SCOPE,
                        "holder": holder, "codec": 1, "size": 737_780,
                        "digest": "sha-256:" + "ab" * 32,
                        "residency": [{"tier": "host", "layers": [0, 29]}],
                        "ttl_ms": 3_600_000,
                    }
                )
            )  # fmt: skip
    return out


def statuses() -> list[InstanceStatusRecord]:
    return [
        InstanceStatusRecord.parse(
            {
                "instance": f"http://127.0.0.1:{9600 + n}/kvsp/", "epoch": 1, "state": "active",
                "running": n % 5, "queued": n % 3, "batch_size": 16,
                "kv_utilization": 0.5, "prefill_tokens_per_s": 4000 + 50 * n,
                "decode_tokens_per_s": 60,
                "links": [
                    {"holder": h, "mbit_per_s": 10_000 + 1000 * ((n + j) % 7), "rtt_us": 40}
                    for j, h in enumerate(HOLDERS)
                ],
                "ttl_ms": 3_600_000,
            }
        )
        for n in range(INSTANCES)
    ]  # fmt: skip


async def pure(prompts: list[list[int]]) -> dict[str, float]:
    index = IndexService(MemoryReplicaStore(SystemClock(), IndexLimits(max_ttl_ms=3_600_000)))
    for tokens in prompts:
        await index.publish(DEVELOPMENT, records(keys_of(tokens)))
    active = statuses()
    for status in active:
        await index.put_status(DEVELOPMENT, status)
    targets = tuple(s.instance for s in active)
    policy = PlacementPolicy()
    spent = {"keys": 0.0, "lookup": 0.0, "scoring": 0.0}
    done = 0
    start = time.perf_counter()
    while time.perf_counter() - start < SECONDS:
        tokens = prompts[done % len(prompts)]
        t0 = time.perf_counter()
        keys = keys_of(tokens)
        t1 = time.perf_counter()
        answer = LookupResponse.parse(
            await index.lookup(
                DEVELOPMENT,
                LookupRequest(
                    scope_id=SCOPE, compat_id=COMPAT, block_keys=keys, targets=targets,
                    block_tokens=BLOCK_TOKENS,
                ),
            )
        )  # fmt: skip
        t2 = time.perf_counter()
        request = PlacementRequest(SCOPE, COMPAT, keys, len(tokens), BLOCK_TOKENS)
        decision = place(request, answer, active, [], policy)
        t3 = time.perf_counter()
        assert decision.matched_blocks == BLOCKS
        spent["keys"] += t1 - t0
        spent["lookup"] += t2 - t1
        spent["scoring"] += t3 - t2
        done += 1
    total = sum(spent.values())
    return {
        "decisions_per_s": round(done / (time.perf_counter() - start), 1),
        "share_keys": round(spent["keys"] / total, 3),
        "share_lookup": round(spent["lookup"] / total, 3),
        "share_scoring": round(spent["scoring"] / total, 3),
    }


async def http(prompts: list[list[int]], base_url: str) -> dict[str, float]:
    async with IndexClient(base_url) as client:
        for tokens in prompts:
            await client.batch(put=records(keys_of(tokens)))
        active = statuses()
        for status in active:
            await client.put_status(status)
        config = ControllerConfig(tenants=TENANTS, placement=PlacementPolicy(prefetch=False))
        service = ControllerService(config, index=client)  # no instances to prefetch into
        for status in active:
            service.instances.put_status(status)
        targets = tuple(s.instance for s in active)

        async def placements() -> float:
            done, start = 0, time.perf_counter()
            while time.perf_counter() - start < SECONDS:
                placement = await service.place(
                    DEVELOPMENT, "bench", COMPAT, prompts[done % len(prompts)]
                )
                assert placement.decision.matched_blocks == BLOCKS
                done += 1
            return done / (time.perf_counter() - start)

        async def lookups() -> float:
            requests = [
                LookupRequest(
                    scope_id=SCOPE, compat_id=COMPAT, block_keys=keys_of(t), targets=targets,
                    block_tokens=BLOCK_TOKENS,
                )
                for t in prompts
            ]  # fmt: skip
            done, start = 0, time.perf_counter()
            while time.perf_counter() - start < SECONDS:
                await client.lookup(requests[done % len(requests)])
                done += 1
            return done / (time.perf_counter() - start)

        best_place = best_lookup = 0.0
        for _ in range(2):
            best_place = max(best_place, await placements())
            best_lookup = max(best_lookup, await lookups())
        await service.peers.aclose()
    return {
        "decisions_per_s": round(best_place, 1),
        "lookups_per_s": round(best_lookup, 1),
        "ratio_to_lookup": round(best_place / best_lookup, 3),
    }


def main() -> None:
    prompts = [prompt(n) for n in range(32)]
    pure_results = asyncio.run(pure(prompts))
    index = Service("index", "serve", "--max-ttl-ms", "3600000", "--log-level", "warning").start()
    try:
        http_results = asyncio.run(http(prompts, index.base_url))
    finally:
        index.stop()
    print(
        json.dumps(
            {
                "benchmark": "placement",
                "instances": INSTANCES,
                "prompt_blocks": BLOCKS,
                "limits": {"http": "the same IS lookups without the controller (reported)"},
                "results": {"pure": pure_results, "http": http_results},
            }
        )
    )


if __name__ == "__main__":
    main()
